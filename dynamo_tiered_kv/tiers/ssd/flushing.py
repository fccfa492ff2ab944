"""The ``SegmentSource`` face the SSD tier shows the object-tier flusher: sealed segments to
upload (live records only), pins that keep them from eviction during an upload, and the durable
``flushed`` mark (a marker file beside the segment).

``FlushSource`` holds the four ``tiers.segments.SegmentSource`` methods; ``SSDTier`` delegates
them to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..segments import SealedSegment, SegmentEntry
from .recovery import fsync_dir
from .segment import flushed_marker, read_footer_at
from .state import SegmentLogState, SegmentState

if TYPE_CHECKING:
    from ..base import ResidencyHook


class FlushSource:
    """Sealed segments for the object-tier flusher: list, pin, mark flushed (durably).

    Built by ``SSDTier`` with the shared ``SegmentLogState`` and a getter of the tier's residency
    hook as it is now (``Tier.set_residency_hook`` may replace it): told which keys reached the
    object tier. Threads: the flusher's (any thread); segment counters under the state's lock,
    file work outside it.
    """

    def __init__(self, state: SegmentLogState, residency_hook: Callable[[], ResidencyHook | None]) -> None:
        self._state = state
        self._residency_hook = residency_hook

    def _seg_by_id(self, segment_id: str) -> SegmentState | None:
        rank_name, _, seq = segment_id.rpartition("/")
        if rank_name != self._state.rank_dir.name or not seq.isdigit():
            return None
        return self._state.segments.get(int(seq))

    def _live(self, seq: int, entries: tuple[SegmentEntry, ...]) -> tuple[SegmentEntry, ...]:
        """The entries whose key the index still places at that record: a record deleted (expired,
        demoted, released) or superseded since the seal is not published, so it cannot come back
        through the object tier."""
        st = self._state
        out = []
        with st.lock:
            for e in entries:
                ent = st.index.entry(e.key)
                if ent is not None and ent[0] == seq and ent[1] == e.offset:  # each names its tenant (manifests)
                    out.append(e if e.tenant == ent[3] else SegmentEntry(e.key, e.offset, e.length, ent[3]))
        return tuple(out)

    def unflushed_segments(self) -> list[SealedSegment]:
        """Sealed segments not yet in the object tier, oldest first, each with its live records
        only (one with none is left to reclaim). Marks a flusher as attached."""
        st = self._state
        st.flusher_attached = True
        with st.lock:
            segs = sorted((s for s in st.segments.values() if s.sealed and not s.flushed and not s.dead),
                          key=lambda s: s.seq)
        out = []
        for s in segs:
            entries = s.sealed_entries  # read once: a concurrent mark_flushed may clear it
            if entries is None:
                footer = read_footer_at(s.path, s.size)
                if footer is None:
                    continue
                entries = s.sealed_entries = tuple(SegmentEntry(k, o, n) for k, o, n in zip(
                    footer.entries["key"].tolist(), footer.entries["offset"].tolist(),
                    footer.entries["length"].tolist()))
            live = self._live(s.seq, entries)
            if live:
                out.append(SealedSegment(st.segment_id(s.seq), s.path, s.size, live, s.sealed_at))
        return out

    def mark_flushed(self, segment_id: str) -> None:
        """Durably record that the segment is in the object tier (a marker file beside it); then
        tell the residency hook its keys are in the shared tier."""
        seg = self._seg_by_id(segment_id)
        if seg is None or seg.flushed:
            return
        entries = seg.sealed_entries  # read before it is cleared below
        marker = flushed_marker(seg.path)
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self._state.rank_dir)
        with self._state.lock:
            seg.flushed = True
            seg.sealed_entries = None
        hook = self._residency_hook()
        if hook is not None:
            if entries is None:
                footer = read_footer_at(seg.path, seg.size)
                keys = [] if footer is None else footer.entries["key"].tolist()
            else:
                keys = [e.key for e in self._live(seg.seq, entries)]
            hook.flushed(keys)

    def pin_segment(self, segment_id: str) -> bool:
        with self._state.lock:
            seg = self._seg_by_id(segment_id)
            if seg is None or seg.dead:
                return False
            seg.pins += 1
            return True

    def unpin_segment(self, segment_id: str) -> None:
        with self._state.lock:
            seg = self._seg_by_id(segment_id)
            if seg is not None and seg.pins > 0:
                seg.pins -= 1
