"""Admission (which tiers a block is written to) and retention (how long it stays there)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal

from ..blocks.keys import BlockKey

AdmissionPolicy = Literal["always", "second_hit"]


class Admission:
    """Which tiers a block is written to. Memory tiers admit everything; the rule guards storage.

    ``always``: every offloaded block goes down to every written tier.
    ``second_hit``: a block goes to a storage tier (SSD, objects) only once it has been seen twice
    (offloaded or loaded again), kvblockd's rule: one-off prefixes never cost SSD writes. This
    holds also when there is no host tier.
    ``min_prefix_blocks``: sequences shorter than this are not offloaded at all.

    Threads: ``sight`` runs on engine threads (offload) and loading threads (promotion), its map
    of sightings (at most ``memory`` keys) behind one lock; ``policy`` and ``min_prefix_blocks``
    are set once and only read.
    """

    def __init__(self, policy: AdmissionPolicy = "always", min_prefix_blocks: int = 1,
                 memory: int = 1 << 16) -> None:
        if policy not in ("always", "second_hit"):
            raise ValueError(f"unknown admission policy {policy!r}")
        self.policy = policy
        self.min_prefix_blocks = max(1, min_prefix_blocks)
        self._seen: OrderedDict[BlockKey, int] = OrderedDict()
        self._memory = memory
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def sight(self, key: BlockKey) -> int:
        """Record one sighting of ``key``; return how often it has been seen (bounded memory)."""
        with self._lock:
            n = self._seen.pop(key, 0) + 1
            self._seen[key] = n
            if len(self._seen) > self._memory:
                self._seen.popitem(last=False)
            return n

    def admits(self, medium: str, sightings: int) -> bool:
        """``medium``: the tier's ``capabilities.medium`` ("host" is memory, always admitted)."""
        return medium == "host" or self.policy == "always" or sightings >= 2


class Retention:
    """Write times of the keys a store put into one tier, oldest first, for TTL sweeps.

    Only blocks this process wrote are tracked: blocks recovered from disk or written by other
    nodes age out through the tier's own retention (SSD eviction, object GC). A key leaves on TTL
    expiry or when the tier drops it (``forget``: eviction, delete, cache reset), so the map holds
    at most what the tier holds. Drops nobody reported (another node's GC of a shared tier) are
    pruned once the map outgrows the tier's block count (``holds``/``held_blocks``, both from the
    tier's in-memory index): ~180 B per key must not grow with the bytes written, only with capacity.

    Threads: ``touch`` and ``expired`` run on the store's loop thread, ``forget`` also on a tier's
    writer thread (its eviction hook); every method takes the one lock. ``holds`` is called under
    it and must not call back into this object. ``keep`` (set by the store) names blocks a retention
    class protects: their TTL is renewed instead of expiring (``retention.py``: a hint's duration
    outlives the tier's default TTL).
    """

    #: pruning waits until this many stale entries may have piled up (amortises the scan)
    PRUNE_SLACK = 1024

    def __init__(self, ttl_s: float | None, holds: Callable[[BlockKey], bool] | None = None,
                 held_blocks: Callable[[], int] | None = None) -> None:
        self.ttl_s = ttl_s
        self._written: OrderedDict[BlockKey, float] = OrderedDict()
        self._holds = holds
        self._held_blocks = held_blocks
        self._limit = self.PRUNE_SLACK  # size at which the tier's block count is next asked for
        self._lock = threading.Lock()
        self.keep: Callable[[BlockKey], bool] | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._written)

    def touch(self, key: BlockKey, now: float) -> None:
        if self.ttl_s is None:
            return
        with self._lock:
            self._written.pop(key, None)
            self._written[key] = now
            if len(self._written) > self._limit and self._holds is not None and self._held_blocks is not None:
                self._limit = 2 * self._held_blocks() + self.PRUNE_SLACK
                if len(self._written) > self._limit:
                    self._prune_locked()

    def _prune_locked(self) -> None:
        assert self._holds is not None
        holds = self._holds
        for key in [k for k in self._written if not holds(k)]:
            del self._written[key]

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """The tier no longer holds ``keys`` (evicted, deleted): stop tracking them."""
        if self.ttl_s is None:
            return
        with self._lock:
            for key in keys:
                self._written.pop(key, None)

    def expired(self, now: float) -> list[BlockKey]:
        out: list[BlockKey] = []
        if self.ttl_s is None:
            return out
        kept: list[BlockKey] = []
        with self._lock:
            while self._written:
                key, t = next(iter(self._written.items()))
                if now - t < self.ttl_s:
                    break
                self._written.popitem(last=False)
                (kept if self.keep is not None and self.keep(key) else out).append(key)
            for key in kept:  # protected: checked again one TTL from now
                self._written[key] = now
        return out
