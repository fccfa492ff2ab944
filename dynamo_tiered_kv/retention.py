"""Retention classes: a per-block (priority, expiry) a tier's eviction honours.

A block retained at priority ``p`` (1-100) until ``expiry`` (clock seconds; None: no expiry)
is *protected*: a tier evicts every unprotected block before it, and among protected blocks
the lowest priority first (then the earliest expiry; least recently used among equals, which
is the tier's own order). Once its expiry passes the block is *expired*: it goes before every
other block, and a GC pass (``TieredStore.expire``) deletes it from every tier.

Protection is bounded so hints can never wedge a tier: at most ``max_share`` of the tier's
capacity may be protected. A new protection that goes beyond the bound makes the lowest
protections yield (lowest priority, then earliest expiry; the newcomer too if it is the
lowest): a yielded block stays cached as an ordinary one. Each yield is counted
(``dtkv_retention_yielded_blocks_total``).

Priority 0 releases: the block becomes ordinary at once.

The clock is injected (``clock``), so tests and the session benchmark run hours of retention
on a compressed clock; production uses ``time.time`` so expiries mean the same in every
process (the object tier persists them in its manifests, docs/FORMAT.md).

Threads: every method takes the one lock; tiers call ``rank``/``protected`` under their own
lock (this lock is innermost and never calls out).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from .keys import BlockKey

DEFAULT_MAX_SHARE = 0.5
MAX_PRIORITY = 100

YIELDED = Counter("dtkv_retention_yielded_blocks", "Protected blocks that lost their protection to the "
                  "protected-share bound (retain_max_share)", ["tier"])
EXPIRED = Counter("dtkv_retention_expired_blocks", "Retained blocks whose expiry passed", ["tier"])
PROTECTED_BYTES = Gauge("dtkv_retention_protected_bytes", "Bytes of protected blocks", ["tier"])


@dataclass(frozen=True, slots=True)
class Retained:
    """``priority`` 1-100 until ``expiry`` (None: none); ``nbytes`` counts toward the share bound."""

    priority: int
    expiry: float | None
    nbytes: int

    def rank(self) -> tuple[int, float]:
        return self.priority, math.inf if self.expiry is None else self.expiry


class RetentionClasses:
    """The retained blocks of one tier (module docstring)."""

    def __init__(self, capacity_bytes: int, *, max_share: float = DEFAULT_MAX_SHARE,
                 clock: Callable[[], float] = time.time, tier: str = "tier") -> None:
        if not 0.0 <= max_share <= 1.0:
            raise ValueError("max_share must be in [0, 1]")
        self.capacity_bytes = capacity_bytes
        self.max_share = max_share
        self.clock = clock
        self.tier = tier
        self._map: dict[BlockKey, Retained] = {}
        self._bytes = 0
        # lazy heaps: an entry is current only while _map still holds the same Retained object
        self._by_rank: list[tuple[int, float, int, BlockKey, Retained]] = []
        self._by_expiry: list[tuple[float, int, BlockKey, Retained]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.yielded = 0  # lifetime count, also exported as a metric

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    @property
    def protected_bytes(self) -> int:
        return self._bytes

    @property
    def bound_bytes(self) -> int:
        return int(self.capacity_bytes * self.max_share)

    def get(self, key: BlockKey) -> Retained | None:
        return self._map.get(key)

    def items(self) -> list[tuple[BlockKey, Retained]]:
        with self._lock:
            return list(self._map.items())

    # --- changes ----------------------------------------------------------------------------
    def set(self, key: BlockKey, priority: int, expiry: float | None, nbytes: int) -> bool:
        """Protect ``key`` (priority 0: release it). Returns whether it is protected afterwards
        (False: released, already expired, or yielded to the share bound)."""
        if priority <= 0:
            self.release([key])
            return False
        priority = min(priority, MAX_PRIORITY)
        now = self.clock()
        if expiry is not None and expiry <= now:
            self.release([key])
            return False
        r = Retained(priority, expiry, max(0, nbytes))
        with self._lock:
            self._drop_locked(key)
            self._map[key] = r
            self._bytes += r.nbytes
            seq = next(self._seq)
            heapq.heappush(self._by_rank, (*r.rank(), seq, key, r))
            if expiry is not None:
                heapq.heappush(self._by_expiry, (expiry, seq, key, r))
            self._bound_locked()
            kept = self._map.get(key) is r
        PROTECTED_BYTES.labels(self.tier).set(self._bytes)
        return kept

    def release(self, keys: Iterable[BlockKey]) -> None:
        """Make ``keys`` ordinary blocks again (priority 0)."""
        with self._lock:
            for key in keys:
                self._drop_locked(key)
        PROTECTED_BYTES.labels(self.tier).set(self._bytes)

    forget = release  # the tier dropped the blocks

    def _drop_locked(self, key: BlockKey) -> Retained | None:
        r = self._map.pop(key, None)
        if r is not None:
            self._bytes -= r.nbytes
        return r

    def _bound_locked(self) -> None:
        bound = self.bound_bytes
        while self._bytes > bound and self._by_rank:
            *_, key, r = heapq.heappop(self._by_rank)
            if self._map.get(key) is r:
                self._drop_locked(key)
                self.yielded += 1
                YIELDED.labels(self.tier).inc()
        if len(self._by_rank) > 2 * len(self._map) + 1024:  # stale entries: rebuild
            self._by_rank = [e for e in self._by_rank if self._map.get(e[3]) is e[4]]
            heapq.heapify(self._by_rank)

    # --- questions eviction asks ------------------------------------------------------------
    def priority(self, key: BlockKey, now: float | None = None) -> int:
        """The block's class: -1 expired, 0 ordinary, 1-100 protected."""
        r = self._map.get(key)
        if r is None:
            return 0
        if r.expiry is not None and r.expiry <= (self.clock() if now is None else now):
            return -1
        return r.priority

    def protected(self, key: BlockKey, now: float | None = None) -> bool:
        return self.priority(key, now) > 0

    def rank(self, key: BlockKey, now: float) -> tuple[int, float]:
        """Eviction order key: smaller goes first (expired, ordinary, then by priority/expiry)."""
        r = self._map.get(key)
        if r is None:
            return 0, 0.0
        if r.expiry is not None and r.expiry <= now:
            return -1, r.expiry
        return r.rank()

    def expired(self, now: float | None = None, limit: int | None = None) -> list[tuple[BlockKey, int]]:
        """Pop up to ``limit`` retained blocks whose expiry passed: ``(key, nbytes)``, earliest first."""
        now = self.clock() if now is None else now
        out: list[tuple[BlockKey, int]] = []
        with self._lock:
            while self._by_expiry and self._by_expiry[0][0] <= now and (limit is None or len(out) < limit):
                _, _, key, r = heapq.heappop(self._by_expiry)
                if self._map.get(key) is r:
                    self._drop_locked(key)
                    out.append((key, r.nbytes))
        if out:
            EXPIRED.labels(self.tier).inc(len(out))
            PROTECTED_BYTES.labels(self.tier).set(self._bytes)
        return out

    def peek_expired(self, now: float) -> list[BlockKey]:
        """Keys whose expiry passed, left in place (eviction takes them first)."""
        with self._lock:
            return [k for e, _, k, r in self._by_expiry if e <= now and self._map.get(k) is r]
