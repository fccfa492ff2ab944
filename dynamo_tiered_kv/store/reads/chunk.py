"""One chunk of a restore in flight, and who frees its staging slab (``store.reads.pipeline``)."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

from ...staging.device_slabs import DeviceSlab, DeviceSpan
from ...staging.slabs import Slab
from ...tiers.base import ReadBudget


class Handoff:
    """Who releases a load slab: the reader if the caller gave up waiting, else the caller.

    The reader (on the loop or a helper thread) and the calling thread both change it, only
    under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.done = False

    def finish(self) -> bool:
        """The reader is past its I/O: whether the caller gave up, so the reader frees the slab."""
        with self.lock:
            self.done = True
            return self.abandoned


@dataclass
class ChunkRead:
    """One chunk of a load: read on the loop or a helper (``fut``) or, ``in_place`` = host tier
    index, on the caller.

    ``spans``/``nbytes`` are written by the reader and read by the caller only after ``fut``
    completed (the future orders the two)."""

    start: int
    end: int
    slab: Slab | DeviceSlab
    fut: concurrent.futures.Future | None
    hand: Handoff
    in_place: int | None = None
    frugal: bool = False  # a pacer limits the load: read in the tier's fewest requests (its CPU is the forward's)
    spans: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # tier -> read intervals
    nbytes: dict[int, int] = field(default_factory=dict)  # tier -> bytes arrived
    budget: ReadBudget | None = None  # the load's bound on its object-tier reads (``read_budget``)
    stalled: bool = False  # a tier gave up a read of this chunk for silence (``SourceStalled``)


def slot_view(slab: Slab | DeviceSlab, offset: int, nbytes: int) -> memoryview | DeviceSpan:
    """``nbytes`` of ``slab`` from ``offset``: a host memoryview, or a span of a device slab."""
    if isinstance(slab, DeviceSlab):
        return DeviceSpan(slab, offset, nbytes)
    return memoryview(slab.array[offset:offset + nbytes])
