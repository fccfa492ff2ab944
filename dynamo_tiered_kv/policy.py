"""Admission (which tiers a block is written to) and retention (how long it stays there)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Literal

from .keys import BlockKey

AdmissionPolicy = Literal["always", "second_hit"]


class Admission:
    """Which tiers a block is written to. Memory tiers admit everything; the rule guards storage.

    ``always``: every offloaded block goes down to every written tier.
    ``second_hit``: a block goes to a storage tier (SSD, objects) only once it has been seen twice
    (offloaded or loaded again), kvblockd's rule: one-off prefixes never cost SSD writes. This
    holds also when there is no host tier.
    ``min_prefix_blocks``: sequences shorter than this are not offloaded at all.
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
    nodes age out through the tier's own retention (SSD eviction, object GC).
    """

    def __init__(self, ttl_s: float | None) -> None:
        self.ttl_s = ttl_s
        self.written: OrderedDict[BlockKey, float] = OrderedDict()

    def touch(self, key: BlockKey, now: float) -> None:
        if self.ttl_s is not None:
            self.written.pop(key, None)
            self.written[key] = now

    def expired(self, now: float) -> list[BlockKey]:
        out: list[BlockKey] = []
        if self.ttl_s is None:
            return out
        while self.written:
            key, t = next(iter(self.written.items()))
            if now - t < self.ttl_s:
                break
            self.written.popitem(last=False)
            out.append(key)
        return out
