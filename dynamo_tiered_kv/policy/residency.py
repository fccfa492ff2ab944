"""Residency: which tier holds a block, told to whoever asks (the connector's KV events).

The store reports every change of where a block lives to one ``ResidencyListener``:

* ``stored(medium, keys)`` after a tier write succeeded (offload, promotion, direct object write),
  and, for the shared object tier, when the flusher marked an SSD segment flushed (its records
  are in the object tier from then on);
* ``removed(medium, keys)`` when a tier dropped the blocks: host LRU eviction, SSD segment
  eviction, TTL expiry, deletes of corrupt records, cache reset (``drop_local``).

Mediums are the strings Dynamo's KV router maps to its storage tiers (``StorageTier::from_kv_medium``:
CPU_PINNED -> HostPinned, DISK -> Disk, EXTERNAL -> External), so a listener can put them into
vLLM ``BlockStored``/``BlockRemoved`` events unchanged. Tiers know nothing of engines or events:
the store installs a ``TierHook`` on each tier (``Tier.set_residency_hook``), which speaks keys only
and is bound to the tier's medium. Not seen: blocks present at start (SSD recovery), and objects
that another node's GC or ``fsck`` deletes from the shared tier.

Listeners are called on the store's loop thread or a tier's writer thread, never while a tier
holds its lock; they must be quick and thread-safe. A listener that raises is logged, never
propagated into the tier. A tier reads its ``residency_hook`` once per report; hooks are
immutable, so installing new ones while a tier reports is safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ..blocks.keys import BlockKey

if TYPE_CHECKING:
    from ..tiers.base import Tier

log = logging.getLogger(__name__)

HOST = "CPU_PINNED"  # router: HostPinned (weight --router-host-cache-hit-weight, 0.75)
DISK = "DISK"  # router: Disk (weight --router-disk-cache-hit-weight, 0.25)
EXTERNAL = "EXTERNAL"  # router: External (disk weight); sent with locality REMOTE

#: ``TierCapabilities.medium`` -> router medium
_BY_TIER_MEDIUM = {"host": HOST, "ssd": DISK, "object": EXTERNAL}


def medium_of(tier: Tier) -> str | None:
    """The router medium of ``tier`` (by its ``capabilities.medium``), or None for an unknown kind."""
    return _BY_TIER_MEDIUM.get(tier.capabilities.medium)


class ResidencyListener(Protocol):
    def stored(self, medium: str, keys: Sequence[BlockKey]) -> None: ...

    def removed(self, medium: str, keys: Sequence[BlockKey]) -> None: ...


class TierHook:
    """What a tier calls: ``evicted(keys)`` when it dropped blocks on its own (capacity), and
    ``flushed(keys)`` when its blocks reached the shared tier (SSD segments marked flushed).

    ``on_evicted``: the store's own bookkeeping of the tier (retention), told before the listener.
    Immutable once built: a tier's writer thread calls it while the store may install a new one.
    """

    __slots__ = ("_flush_medium", "_listener", "_medium", "_on_evicted")

    def __init__(self, listener: ResidencyListener | None, medium: str | None, flush_medium: str | None = None,
                 on_evicted: Callable[[Sequence[BlockKey]], None] | None = None) -> None:
        self._listener = listener
        self._medium = medium
        self._flush_medium = flush_medium
        self._on_evicted = on_evicted

    def evicted(self, keys: Sequence[BlockKey]) -> None:
        if not keys:
            return
        if self._on_evicted is not None:
            try:
                self._on_evicted(keys)
            except Exception:
                log.exception("eviction bookkeeping failed (%d blocks); ignored", len(keys))
        if self._listener is not None and self._medium is not None:
            notify(self._listener.removed, self._medium, keys)

    def flushed(self, keys: Sequence[BlockKey]) -> None:
        if keys and self._listener is not None and self._flush_medium is not None:
            notify(self._listener.stored, self._flush_medium, keys)


def notify(fn: Callable[[str, Sequence[BlockKey]], None], medium: str, keys: Sequence[BlockKey]) -> None:
    try:
        fn(medium, keys)
    except Exception:
        log.exception("residency listener failed (%s, %d blocks); ignored", medium, len(keys))


def install(tiers: Sequence[Tier], listener: ResidencyListener | None,
            on_evicted: Sequence[Callable[[Sequence[BlockKey]], None] | None] = ()) -> None:
    """Give each tier a ``residency_hook``: told to ``listener`` (tiers of known medium) and to the
    tier's ``on_evicted[i]`` if any; None when it has neither.

    SSD flushes are announced with the medium of the first shared tier, if any.
    """
    shared = next((medium_of(t) for t in tiers if t.capabilities.shared), None)
    for i, t in enumerate(tiers):
        m = medium_of(t)
        own = on_evicted[i] if i < len(on_evicted) else None
        if (listener is not None and m is not None) or own is not None:
            t.set_residency_hook(TierHook(listener, m, shared, own))
        else:
            t.set_residency_hook(None)
