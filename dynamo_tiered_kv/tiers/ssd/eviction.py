"""Capacity enforcement of the SSD tier: evict whole sealed segments, least recently used first.

Retention classes (``retention``) rank segments before recency: a segment holding a protected
block ranks at its highest protected priority, one holding an expired retained block (and no
protected one) goes before every other, the rest are ordinary (rank 0).

``EvictionMixin`` is mixed into ``SSDTier`` only and uses its segment table, index, lock and I/O
path; it is split out to keep ``tier.py`` short. It runs on the writer thread, the only one that
adds or removes segments (docs/SSD.md section 8).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ...errors import TierFull
from . import metrics
from .flushing import SegmentState
from .index import CompactIndex
from .io import PosixIO
from .segment import flushed_marker, read_footer_at

if TYPE_CHECKING:
    from ...residency import TierHook
    from ...retention import RetentionClasses


class EvictionMixin:
    """``_make_room`` and the evictability rule of ``SSDTier``."""

    _lock: threading.Lock
    _index: CompactIndex
    _segments: dict[int, SegmentState]
    _io: PosixIO | None
    _capacity: int
    _used: int
    _allow_unflushed: bool | None
    _flusher_attached: bool
    #: set by the store (``residency.install``): told which keys segment eviction dropped
    residency_hook: TierHook | None = None
    #: set by the store: per-block (priority, expiry) that ranks segments; None: plain LRU
    retention: RetentionClasses | None = None

    def _close_fd(self, fd: int) -> None:
        raise NotImplementedError  # SSDTier's

    def _evictable(self, seg: SegmentState) -> bool:
        allow = self._allow_unflushed if self._allow_unflushed is not None else not self._flusher_attached
        return seg.sealed and not seg.dead and seg.pins == 0 and (seg.flushed or allow)

    def _make_room(self, need: int) -> None:
        """Evict least recently used segments until ``need`` more bytes fit the budget.

        Runs on the writer thread, the only one that adds or removes segments. The lock is held
        only to pick a victim and to drop its index entries, never across the footer read or the
        unlink, so lookups (``contains`` on the scheduler's hot path) never wait on the disk.
        """
        while True:
            with self._lock:
                if self._used + need <= self._capacity:
                    return
                victims = [s for s in self._segments.values() if self._evictable(s)]
                if not victims or self._used - sum(s.size for s in victims) + need > self._capacity:
                    raise TierFull(f"SSD tier needs {need} bytes, holds {self._used} of {self._capacity}, and "
                                   "evicting every evictable segment (sealed, not pinned, flushed or allowed "
                                   "unflushed) would not make room")
                ranks = self._segment_ranks_locked()
                victim = min(victims, key=lambda s: (ranks.get(s.seq, 0), s.last_used))
            footer = read_footer_at(victim.path, victim.size)
            with self._lock:
                if not self._evictable(victim):  # the flusher pinned it meanwhile: pick again
                    continue
                gone = self._evict_locked(victim, None if footer is None else footer.entries["key"].tolist())
            for p in (victim.path, flushed_marker(victim.path)):
                p.unlink(missing_ok=True)
            metrics.EVICTED_SEGMENTS.inc()
            metrics.USED_BYTES.set(self._used)
            if self.residency_hook is not None:
                self.residency_hook.evicted(gone)

    def _segment_ranks_locked(self) -> dict[int, int]:
        """Segment seq -> its retention rank (absent: 0). Costs one lookup per retained block."""
        cls = self.retention
        if cls is None or not len(cls):
            return {}
        now = cls.clock()
        ranks: dict[int, int] = {}
        for key, _ in cls.items():
            loc = self._index.get(key)
            if loc is not None:
                p = cls.priority(key, now)
                ranks[loc[0]] = max(ranks.get(loc[0], -1), p)
        return ranks

    def _evict_locked(self, seg: SegmentState, keys: list[bytes] | None) -> list[bytes]:
        """Forget ``seg`` (its index entries, its bytes); its fd closes when the last reader leaves.

        Returns the keys this dropped (not those a later segment holds a newer copy of).
        """
        assert self._io is not None
        if keys is None:  # cannot happen for a file we sealed; fall back to a full index sweep
            keys = list(self._index.keys())
        gone = [key for key in keys if self._index.pop(key, only_seq=seg.seq) is not None]
        if self.retention is not None:
            self.retention.forget(gone)
        del self._segments[seg.seq]
        seg.dead = True
        self._used -= seg.size
        if seg.readers == 0:
            self._close_fd(seg.fd)
        return gone
