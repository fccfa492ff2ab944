"""Capacity enforcement of the SSD tier: evict whole sealed segments, least recently used first;
with tenant quotas, a tenant's own segments for its quota, and never a segment of a tenant
within its quota for another tenant's writes while some tenant is over its quota.

Retention classes (``retention``) rank segments before recency: a segment holding a protected
block ranks at its highest protected priority, one holding an expired retained block (and no
protected one) goes before every other, the rest are ordinary (rank 0).

A victim pick must not cost one lookup per retained block: it runs under the tier lock, which
the scheduler's lookups wait on. ``RetainedSegments`` keeps, per segment, the retained keys it
holds and its rank, up to date incrementally: the retention table lists the keys whose claims
changed (``RetentionClasses.take_changes``), the write path reports each run's arrivals (a
retained key written again moves with its newest copy), a segment's live-key count in the index
tells when keys left it (deleted, superseded, dropped as corrupt), and each rank carries the time
it holds until (a claim lapsing can change it). A pick then costs one check per segment holding
retained keys plus work for what changed since the previous pick.

``Evictor`` is the part of ``SSDTier`` that makes room: it works on the shared
``SegmentLogState`` and runs on the writer thread, the only one that adds or removes segments
(docs/SSD.md section 8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import TierFull
from . import metrics
from .index import CompactIndex
from .segment import flushed_marker, read_footer_at
from .state import SegmentLogState, SegmentState

if TYPE_CHECKING:
    from ...policy.retention import RetentionClasses


@dataclass(eq=False)
class _SegmentRetention:
    keys: set[bytes] = field(default_factory=set)  # retained keys the segment held when last checked
    rank: int = 0
    until: float = -math.inf  # the rank holds before this clock time (-inf: recompute)
    live: int = -1  # the segment's live-key count when last checked


class RetainedSegments:
    """Segment seq -> the retained keys it holds and its retention rank (module docstring).

    Not thread-safe: ``Evictor`` calls it under the state's lock only.
    """

    def __init__(self) -> None:
        self._segs: dict[int, _SegmentRetention] = {}
        self._seq_of: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._seq_of)

    def rebuild(self, cls: RetentionClasses, index: CompactIndex) -> None:
        """Start over from every retained key (one lookup each): the first pick, or a lost log."""
        self._segs.clear()
        self._seq_of.clear()
        self.changed(cls.retained_keys(), cls, index)

    def changed(self, keys: list[bytes], cls: RetentionClasses, index: CompactIndex) -> None:
        """Claims on ``keys`` changed: track each where the index places it, if still retained."""
        for key in keys:
            loc = index.get(key) if key in cls else None
            if loc is None:
                self._untrack(key)
            else:
                self._track(key, loc[0])

    def arrived(self, seq: int, keys: Iterable[bytes], cls: RetentionClasses) -> None:
        """``keys`` were just written into segment ``seq`` (the newest copy of each)."""
        seg = self._segs.get(seq)
        if seg is not None:  # its count of live keys may net out a departure: look again
            seg.until = -math.inf
        for key in keys:
            if key in cls:
                self._track(key, seq)
            elif key in self._seq_of:
                self._untrack(key)

    def dropped(self, seq: int) -> None:
        """Segment ``seq`` left the tier."""
        seg = self._segs.pop(seq, None)
        if seg is not None:
            for key in seg.keys:
                if self._seq_of.get(key) == seq:
                    del self._seq_of[key]

    def ranks(self, cls: RetentionClasses, index: CompactIndex, live_seqs: Container[int],
              now: float) -> dict[int, int]:
        """Seq -> rank of every segment holding a retained key (absent: rank 0)."""
        for seq in [s for s in self._segs if s not in live_seqs]:  # the tier dropped its state
            self.dropped(seq)
        todo = list(self._segs)
        while todo:  # a recompute may find a key moved to a segment not looked at yet
            seq = todo.pop()
            seg = self._segs.get(seq)
            if seg is not None and (now >= seg.until or index.live_in(seq) != seg.live):
                todo.extend(self._recompute(seq, seg, cls, index, now))
        return {seq: seg.rank for seq, seg in self._segs.items() if seg.rank}

    def _track(self, key: bytes, seq: int) -> None:
        old = self._seq_of.get(key)
        if old is not None and old != seq:
            self._untrack(key)
        self._seq_of[key] = seq
        seg = self._segs.setdefault(seq, _SegmentRetention())
        seg.keys.add(key)
        seg.until = -math.inf

    def _untrack(self, key: bytes) -> None:
        seq = self._seq_of.pop(key, None)
        if seq is None:
            return
        seg = self._segs[seq]
        seg.keys.discard(key)
        seg.until = -math.inf

    def _recompute(self, seq: int, seg: _SegmentRetention, cls: RetentionClasses, index: CompactIndex,
                   now: float) -> list[int]:
        """One lookup and one class per retained key of this segment; returns the segments keys
        were found to have moved to."""
        rank, until = -1, math.inf
        moved: list[int] = []
        for key in list(seg.keys):
            loc = index.get(key)
            if loc is None or loc[0] != seq:  # deleted or superseded since
                seg.keys.discard(key)
                del self._seq_of[key]
                if loc is not None and key in cls:
                    self._track(key, loc[0])
                    moved.append(loc[0])
                continue
            p, t = cls.standing(key, now)  # 0 only if released meanwhile: its change comes next pick
            rank, until = max(rank, p), min(until, t)
        if not seg.keys:
            del self._segs[seq]
            return moved
        seg.rank, seg.until, seg.live = rank, until, index.live_in(seq)
        return moved


class Evictor:
    """``make_room`` and the evictability rule of ``SSDTier`` (module docstring).

    Built by ``SSDTier`` with the shared ``SegmentLogState``, whether unflushed segments may go
    (``allow_unflushed``; None: until a flusher attaches), the tier's retention table as it is
    now (``retention``: ``Tier.configure_retention`` may replace it; None: plain LRU) and the
    tier's report of dropped keys (``report_evicted``: the residency hook). Threads: the writer
    thread; ``*_locked`` methods are called with the state's lock held.
    """

    def __init__(self, state: SegmentLogState, *, allow_unflushed: bool | None,
                 retention: Callable[[], RetentionClasses | None],
                 report_evicted: Callable[[list[bytes]], None]) -> None:
        self._state = state
        self._allow_unflushed = allow_unflushed
        self._retention = retention
        self._report_evicted = report_evicted
        #: per-segment retention ranks, built on the first victim pick that has a retention table
        self._retained: RetainedSegments | None = None

    def evictable(self, seg: SegmentState) -> bool:
        allow = self._allow_unflushed if self._allow_unflushed is not None else not self._state.flusher_attached
        return seg.sealed and not seg.dead and seg.pins == 0 and (seg.flushed or allow)

    def make_room(self, need: int, tenant: bytes | None = None) -> None:
        """Evict segments until ``need`` more bytes fit the budget and, with quotas, the quota of
        ``tenant`` (the tenant whose records are about to be appended).

        With quotas, a tenant whose charge would pass its limit evicts its own segments first
        (``_own_victim_locked``); then, while the tier is full, tenants over their limit lose
        segments before the writer itself, and a segment holding live records of any other
        tenant within its limit is never taken while a tenant is over its limit
        (``_victim_locked``; the guarantee: docs/SSD.md section 8).

        Raises ``TierFull`` when no allowed eviction would make room. The lock is held only to
        pick a victim and to drop its index entries, never across the footer read or the
        unlink, so lookups (``contains`` on the scheduler's hot path) never wait on the disk.
        """
        st = self._state
        while True:
            with st.lock:
                victim = self._own_victim_locked(need, tenant) if tenant is not None else None
                if victim is None:
                    if st.used + need <= st.capacity:
                        return
                    victim = self._victim_locked(need, tenant)
            footer = read_footer_at(victim.path, victim.size)
            with st.lock:
                if not self.evictable(victim):  # the flusher pinned it meanwhile: pick again
                    continue
                gone = self.evict_locked(victim, None if footer is None else footer.entries["key"].tolist())
            for p in (victim.path, flushed_marker(victim.path)):
                p.unlink(missing_ok=True)
            metrics.EVICTED_SEGMENTS.inc()
            metrics.USED_BYTES.set(st.used)
            self._report_evicted(gone)

    def _own_victim_locked(self, need: int, tenant: bytes) -> SegmentState | None:
        """With quotas: ``tenant``'s own least valuable segment when its charge plus ``need``
        passes its limit (None when it fits, or without quotas)."""
        acc = self._state.tenants
        limit = acc.limit(tenant)
        if limit is None:
            return None
        charge = acc.charge_locked(tenant)
        if charge + need <= limit:
            return None
        own = [s for s in acc.segments_of_locked(tenant)
               if self.evictable(s) and s.owner == tenant and all(t == tenant for t in s.tenants)]
        if not own:
            raise TierFull(f"SSD tier: tenant {tenant.hex()} is charged {charge} of its {limit}-byte quota, needs "
                           f"{need} more, and none of its segments can be evicted (sealed, not pinned, flushed "
                           "or allowed unflushed)")
        ranks = self._segment_ranks_locked()
        return min(own, key=lambda s: (ranks.get(s.seq, 0), s.last_used))

    def _victim_locked(self, need: int, tenant: bytes | None) -> SegmentState:
        """The segment to evict for capacity: by retention rank, then least recently used; with
        quotas and a tenant over its limit, only segments whose live records are all of tenants
        over their limit (first) or of the writer ``tenant`` (next)."""
        st = self._state
        victims = [s for s in st.segments.values() if self.evictable(s)]
        if not victims or st.used - sum(s.size for s in victims) + need > st.capacity:
            raise TierFull(f"SSD tier needs {need} bytes, holds {st.used} of {st.capacity}, and "
                           "evicting every evictable segment (sealed, not pinned, flushed or allowed "
                           "unflushed) would not make room")
        ranks = self._segment_ranks_locked()
        over = st.tenants.over_locked()
        if not over:  # no quota, or no tenant over its limit (limits that add up past the capacity)
            return min(victims, key=lambda s: (ranks.get(s.seq, 0), s.last_used))
        allowed = [(0 if all(t in over for t in s.tenants) else 1, s) for s in victims
                   if all(t in over or t == tenant for t in s.tenants)]
        if not allowed:
            raise TierFull(f"SSD tier needs {need} bytes, holds {st.used} of {st.capacity}; the tenants over "
                           "their quota hold no evictable segment, and segments of tenants within their quota "
                           "are not evicted for another tenant")
        return min(allowed, key=lambda a: (a[0], ranks.get(a[1].seq, 0), a[1].last_used))[1]

    def _segment_ranks_locked(self) -> dict[int, int]:
        """Segment seq -> its retention rank (absent: 0). Costs one check per segment holding a
        retained key plus the changes since the previous pick (module docstring)."""
        cls = self._retention()
        if cls is None:
            return {}
        st = self._state
        rs = self._retained
        changes = cls.take_changes()
        if rs is None or changes is None:
            rs = self._retained = RetainedSegments()
            rs.rebuild(cls, st.index)
        else:
            rs.changed(changes, cls, st.index)
        return rs.ranks(cls, st.index, st.segments, cls.clock())

    def arrived_locked(self, seq: int, keys: Iterable[bytes]) -> None:
        """The write path: ``keys`` now live in segment ``seq`` (under the state's lock)."""
        rs, cls = self._retained, self._retention()
        if rs is not None and cls is not None:
            rs.arrived(seq, keys, cls)

    def evict_locked(self, seg: SegmentState, keys: list[bytes] | None) -> list[bytes]:
        """Forget ``seg`` (its index entries, its bytes); its fd closes when the last reader leaves.

        Returns the keys this dropped (not those a later segment holds a newer copy of).
        """
        st = self._state
        if keys is None:  # cannot happen for a file we sealed; fall back to a full index sweep
            keys = list(st.index.keys())
        gone = [key for key in keys if st.pop_locked(key, only_seq=seg.seq) is not None]
        cls = self._retention()
        if cls is not None:
            cls.forget(gone)
        if self._retained is not None:
            self._retained.dropped(seg.seq)
        st.remove_segment_locked(seg)
        return gone
