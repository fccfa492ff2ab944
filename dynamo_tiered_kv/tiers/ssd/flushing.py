"""The tier's in-memory segment state, and the ``SegmentSource`` face it shows the flusher.

``SegmentSourceMixin`` holds the four ``tiers.segments.SegmentSource`` methods. It is mixed into
``SSDTier`` only and uses the tier's segment table (``_segments``), lock (``_lock``) and rank
directory; it is split out to keep the flusher contract in one short file.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..segments import SealedSegment, SegmentEntry
from .index import CompactIndex
from .recovery import fsync_dir
from .segment import flushed_marker, read_footer_at

if TYPE_CHECKING:
    from ..base import ResidencyHook


@dataclass(eq=False)
class SegmentState:
    seq: int
    path: Path
    fd: int
    data_bytes: int
    size: int  # bytes the file holds (sealed) or will hold once sealed (open: data + footer)
    sealed: bool
    flushed: bool = False
    sealed_at: float = 0.0
    last_used: int = 0
    pins: int = 0
    readers: int = 0
    dead: bool = False
    entries: list[tuple[bytes, int, int]] = field(default_factory=list)  # open segment only
    sealed_entries: tuple[SegmentEntry, ...] | None = None  # cached for the flusher


class SegmentSourceMixin:
    """Sealed segments for the object-tier flusher: list, pin, mark flushed (durably)."""

    rank_dir: Path
    _segments: dict[int, SegmentState]
    _lock: threading.Lock
    _flusher_attached: bool
    _index: CompactIndex
    #: the store's listener (``Tier.set_residency_hook``): told which keys reached the object tier
    _residency_hook: ResidencyHook | None

    # --- SegmentSource (for the object-tier flusher) ----------------------------------------
    def _segment_id(self, seq: int) -> str:
        return f"{self.rank_dir.name}/{seq:08d}"

    def _seg_by_id(self, segment_id: str) -> SegmentState | None:
        rank_name, _, seq = segment_id.rpartition("/")
        if rank_name != self.rank_dir.name or not seq.isdigit():
            return None
        return self._segments.get(int(seq))

    def _live(self, seq: int, entries: tuple[SegmentEntry, ...]) -> tuple[SegmentEntry, ...]:
        """The entries whose key the index still places at that record: a record deleted (expired,
        demoted, released) or superseded since the seal is not published, so it cannot come back
        through the object tier."""
        with self._lock:
            return tuple(e for e in entries if (loc := self._index.get(e.key)) is not None
                         and loc[0] == seq and loc[1] == e.offset)

    def unflushed_segments(self) -> list[SealedSegment]:
        """Sealed segments not yet in the object tier, oldest first, each with its live records
        only (one with none is left to reclaim). Marks a flusher as attached."""
        self._flusher_attached = True
        with self._lock:
            segs = sorted((s for s in self._segments.values() if s.sealed and not s.flushed and not s.dead),
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
                out.append(SealedSegment(self._segment_id(s.seq), s.path, s.size, live, s.sealed_at))
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
        fsync_dir(self.rank_dir)
        with self._lock:
            seg.flushed = True
            seg.sealed_entries = None
        hook = self._residency_hook
        if hook is not None:
            if entries is None:
                footer = read_footer_at(seg.path, seg.size)
                keys = [] if footer is None else footer.entries["key"].tolist()
            else:
                keys = [e.key for e in self._live(seg.seq, entries)]
            hook.flushed(keys)

    def pin_segment(self, segment_id: str) -> bool:
        with self._lock:
            seg = self._seg_by_id(segment_id)
            if seg is None or seg.dead:
                return False
            seg.pins += 1
            return True

    def unpin_segment(self, segment_id: str) -> None:
        with self._lock:
            seg = self._seg_by_id(segment_id)
            if seg is not None and seg.pins > 0:
                seg.pins -= 1
