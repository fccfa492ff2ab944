"""Handles the object tier's read path works with: an indexed object (``ObjectRef``), the
``key -> (object, entry)`` view over the catalog (``IndexView``), one wanted byte run
(``Want``), and ``cancel_and_wait`` for the runs of a read that failed.

Threads: made and used on the tier's event loop (``ObjectTier.read_many``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...blocks.keys import BlockKey
from ..segments import SegmentEntry

if TYPE_CHECKING:
    from .catalog import Catalog


class _HasCatalog:
    """What ``IndexView`` reads of the tier: its current catalog."""

    _cat: Catalog


@dataclass(frozen=True, slots=True)
class _Ref:
    data: str


class ObjectRef:
    """A handle on one indexed object, made on lookup (the index itself holds only numbers)."""

    __slots__ = ("_cat", "id", "manifest")

    def __init__(self, cat: Catalog, i: int) -> None:
        self.id, self._cat = i, cat
        self.manifest = _Ref(cat.data_name(i))

    @property
    def live(self) -> range:
        return range(int(np.count_nonzero(self._cat.index.obj == self.id)))


class IndexView:
    """``key -> (ObjectRef, SegmentEntry)`` over the catalog, as the read path expects it."""

    def __init__(self, tier: _HasCatalog) -> None:
        self._tier = tier

    def get(self, key: BlockKey) -> tuple[ObjectRef, SegmentEntry] | None:
        cat = self._tier._cat
        loc = cat.index.get(key)
        return None if loc is None else (ObjectRef(cat, loc[0]), SegmentEntry(key, loc[1], loc[2]))


@dataclass
class Want:
    offset: int  # absolute offset in the data object
    length: int
    index: int  # position in the request list
    dest: memoryview
    key: BlockKey
    whole: bool  # a whole record (verifiable)


async def cancel_and_wait(tasks: list[asyncio.Future[None]]) -> None:
    """Cancel ``tasks`` and wait until every one has finished, even if we are cancelled meanwhile."""
    for t in tasks:
        t.cancel()
    cancelled = False
    while not all(t.done() for t in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            cancelled = True
    for t in tasks:  # mark their outcomes retrieved (the caller raises its own error)
        if not t.cancelled():
            t.exception()
    if cancelled:
        raise asyncio.CancelledError
