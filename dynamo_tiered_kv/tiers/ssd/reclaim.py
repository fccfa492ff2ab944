"""Free the disk bytes of deleted records, not only their index entries (docs/SSD.md section 8).

A delete (or an overwrite) drops the index entry and appends a tombstone; the record's bytes stay
in its segment file. Once the tombstones are durable, ``Reclaimer`` frees them:

* a sealed segment left without a live record is unlinked at once, the way eviction drops one
  (index, used bytes and the segment table first, then the files; a read in flight keeps the fd
  and the last reader closes it);
* in a sealed segment that still holds live records, the whole filesystem blocks inside each dead
  record are punched out (``holes.punch_hole``). The file keeps its size, so offsets, the footer
  and the entries stay valid; the record reads as zeros and its tombstone keeps it out of the
  index. A filesystem that refuses (EOPNOTSUPP) turns punching off with one log line and
  ``dtkv_ssd_punch_unsupported``; the bytes then wait for eviction as before.

Open segments are never touched: recovery scans them record by record, and a hole would read as
damage there. What cannot be freed yet is retried at the next delete call or seal. An emptied
segment is unlinked once no upload pins it, flushed or not: the flusher publishes live records
only (``FlushSource.unflushed_segments``), so nothing of it is owed to the object tier.
Punching waits while the segment is being read (a read planned before the delete may still
want those bytes) and, with a flusher attached, until the segment is flushed (the upload reads
the whole file). The newest segment file is punched rather than unlinked: recovery derives the
next seq from the files, and a seq is never reused. Everything runs on the writer thread;
sealing the open segment so its deleted records can be freed is ``Sealer.seal_deleted``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from ...blocks.codec import ALIGN
from . import metrics
from .eviction import Evictor
from .holes import UNSUPPORTED, punch_hole, whole_blocks
from .segment import flushed_marker
from .state import SegmentLogState, SegmentState
from .tombstones import TombstoneLog

log = logging.getLogger(__name__)


class Reclaimer:
    """Deletes, and the freeing of dead records' bytes: unlink emptied sealed segments, punch
    deleted records out of the others (module docstring).

    Built by ``SSDTier`` with the shared ``SegmentLogState``, the ``TombstoneLog`` (deletes are
    recorded there first) and the ``Evictor`` (an emptied segment leaves the way an evicted one
    does). Threads: the writer thread only.
    """

    def __init__(self, state: SegmentLogState, tombstones: TombstoneLog, evictor: Evictor) -> None:
        self._state = state
        self._tombstones = tombstones
        self._evictor = evictor
        #: seq -> (offset, length) of its dead records whose tombstones are written, not yet freed;
        #: a seq with an empty list is a segment without live records waiting to be unlinked
        self._dead: dict[int, list[tuple[int, int]]] = {}
        self._punch_ok = True
        self._fs_block = ALIGN

    @property
    def punching(self) -> bool:
        """Whether the filesystem punches holes (False once it refused)."""
        return self._punch_ok

    def has_dead(self, seq: int) -> bool:
        """Whether segment ``seq`` holds dead records (or none live) not yet freed."""
        return seq in self._dead

    def probe_fs_block(self) -> None:
        """Learn the filesystem block (what a punch frees at least), while opening."""
        try:
            self._fs_block = max(ALIGN, os.statvfs(self._state.rank_dir).f_frsize)
        except OSError:
            self._fs_block = ALIGN

    def clear(self) -> None:
        """Forget every pending reclaim (the tier dropped its segments)."""
        self._dead.clear()

    def note_dead(self, locs: Iterable[tuple[int, int, int]]) -> None:
        """Remember dead records ``(seq, offset, length)`` whose tombstones were written."""
        for seq, off, n in locs:
            self._dead.setdefault(seq, []).append((off, n))

    def note_empty_segments(self, seqs: Iterable[int]) -> None:
        """After recovery: segments every record of which is dead are candidates for unlinking."""
        st = self._state
        for seq in seqs:
            if seq in st.segments and st.index.live_in(seq) == 0:
                self._dead.setdefault(seq, [])

    def delete(self, keys: list[bytes]) -> int:
        """Drop ``keys`` from the index; one tombstone append (one fdatasync) for the whole batch,
        then free the records' bytes. Returns how many were present."""
        st = self._state
        locs = []
        with st.lock:
            for key in keys:
                e = st.pop_locked(key)
                if e is not None:
                    locs.append((e[:3], key))
        if locs and self._tombstones.append([(s, o, k) for (s, o, _), k in locs]):
            self.note_dead(loc for loc, _ in locs)
        self.reclaim()  # also what an earlier batch had to defer
        return len(locs)

    def reclaim(self) -> None:
        """Free what the rules allow now (module docstring); keep the rest for a later pass."""
        if not self._dead:
            return
        st = self._state
        unlinked: list[SegmentState] = []
        punch: list[tuple[SegmentState, list[tuple[int, int]]]] = []
        with st.lock:
            newest = max(st.segments, default=0)
            for seq in list(self._dead):
                seg = st.segments.get(seq)
                if seg is None or seg.dead:
                    del self._dead[seq]
                    continue
                if not seg.sealed:
                    continue
                empty = st.index.live_in(seq) == 0
                # no live record: nothing of it is owed to the object tier (the flusher publishes
                # live records only), so flushed or not it goes once no upload holds it
                if empty and seq != newest and seg.pins == 0:
                    self._evictor.evict_locked(seg, [])  # no live key: nothing to pop, no hook to tell
                    del self._dead[seq]
                    unlinked.append(seg)
                    continue
                extents = self._dead[seq]
                if extents and not self._punch_ok:
                    extents = []
                elif extents and seg.readers == 0 and (seg.flushed or not st.flusher_attached):
                    punch.append((seg, extents))
                    extents = []
                if extents or empty:
                    self._dead[seq] = extents
                else:
                    del self._dead[seq]
        for seg in unlinked:
            try:
                for p in (seg.path, flushed_marker(seg.path)):
                    p.unlink(missing_ok=True)
            except OSError as e:  # forgotten anyway; the next recovery finds it empty and retries
                log.warning("SSD tier: cannot remove emptied segment %s: %s", seg.path.name, e)
            metrics.RECLAIMED_SEGMENTS.inc()
        if unlinked:
            metrics.USED_BYTES.set(st.used)
        if punch and self._tombstones.make_durable():
            for seg, extents in punch:
                self._punch(seg, extents)

    def _punch(self, seg: SegmentState, extents: list[tuple[int, int]]) -> None:
        inside = [(o, min(n, seg.data_bytes - o)) for o, n in extents if o < seg.data_bytes]  # never the footer
        for off, n in whole_blocks(inside, self._fs_block):
            try:
                punch_hole(seg.fd, off, n)
            except OSError as e:
                if e.errno in UNSUPPORTED:
                    self._punch_ok = False
                    metrics.PUNCH_UNSUPPORTED.inc()
                    log.warning("SSD tier %s: the filesystem cannot punch holes (%s); bytes of deleted records "
                                "stay until their segment is emptied or evicted", self._state.rank_dir, e)
                else:
                    log.warning("SSD tier: cannot free deleted records in %s: %s", seg.path.name, e)
                return
            metrics.PUNCHED_BYTES.inc(n)
