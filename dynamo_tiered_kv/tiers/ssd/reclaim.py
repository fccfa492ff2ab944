"""Free the disk bytes of deleted records, not only their index entries (docs/SSD.md section 8).

A delete (or an overwrite) drops the index entry and appends a tombstone; the record's bytes stay
in its segment file. Once the tombstones are durable, ``ReclaimMixin`` frees them:

* a sealed segment left without a live record is unlinked at once, the way eviction drops one
  (index, ``_used`` and the segment table first, then the files; a read in flight keeps the fd
  and the last reader closes it);
* in a sealed segment that still holds live records, the whole filesystem blocks inside each dead
  record are punched out (``holes.punch_hole``). The file keeps its size, so offsets, the footer
  and the entries stay valid; the record reads as zeros and its tombstone keeps it out of the
  index. A filesystem that refuses (EOPNOTSUPP) turns punching off with one log line and
  ``dtkv_ssd_punch_unsupported``; the bytes then wait for eviction as before.

Open segments are never touched: recovery scans them record by record, and a hole would read as
damage there. What cannot be freed yet is retried at the next delete call or seal. An emptied
segment is unlinked once no upload pins it, flushed or not: the flusher publishes live records
only (``SegmentSourceMixin.unflushed_segments``), so nothing of it is owed to the object tier.
Punching waits while the segment is being read (a read planned before the delete may still
want those bytes) and, with a flusher attached, until the segment is flushed (the upload reads
the whole file). The newest segment file is punched rather than unlinked: recovery derives the
next seq from the files, and a seq is never reused. Everything runs on the writer thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ...blocks.codec import ALIGN
from ...errors import TierUnavailable
from . import metrics
from .flushing import SegmentState
from .holes import UNSUPPORTED, punch_hole, whole_blocks
from .index import CompactIndex
from .segment import flushed_marker

log = logging.getLogger(__name__)


class ReclaimMixin:
    """Unlink emptied sealed segments and punch deleted records out of the others (``SSDTier``)."""

    rank_dir: Path
    disabled_reason: str | None
    _lock: threading.Lock
    _index: CompactIndex
    _segments: dict[int, SegmentState]
    _open: SegmentState | None
    _writer: ThreadPoolExecutor
    _flusher_attached: bool
    _fsync: bool
    _tomb_fd: int | None
    _used: int

    if TYPE_CHECKING:  # SSDTier's (EvictionMixin, SealingMixin); declared for type checkers only
        def _evictable(self, seg: SegmentState) -> bool: ...
        def _evict_locked(self, seg: SegmentState, keys: list[bytes] | None) -> list[bytes]: ...
        def _seal_sync(self) -> object: ...

    def _init_reclaim(self) -> None:
        #: seq -> (offset, length) of its dead records whose tombstones are written, not yet freed;
        #: a seq with an empty list is a segment without live records waiting to be unlinked
        self._dead: dict[int, list[tuple[int, int]]] = {}
        self._punch_ok = True
        self._fs_block = ALIGN
        self._tomb_dirty = False  # tombstones written but not yet fdatasynced (fsync=False)

    def _probe_fs_block(self) -> None:
        try:
            self._fs_block = max(ALIGN, os.statvfs(self.rank_dir).f_frsize)
        except OSError:
            self._fs_block = ALIGN

    def _note_dead(self, locs: Iterable[tuple[int, int, int]]) -> None:
        """Remember dead records ``(seq, offset, length)`` whose tombstones were written."""
        for seq, off, n in locs:
            self._dead.setdefault(seq, []).append((off, n))

    def _note_empty_segments(self, seqs: Iterable[int]) -> None:
        """After recovery: segments every record of which is dead are candidates for unlinking."""
        for seq in seqs:
            if seq in self._segments and self._index.live_in(seq) == 0:
                self._dead.setdefault(seq, [])

    async def seal_deleted(self) -> bool:
        """Seal the open segment if deleted records lie in it, so their bytes are freed now rather
        than once it fills (an expiry pass calls this at its end). Returns whether it sealed."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._seal_deleted_sync)

    def _seal_deleted_sync(self) -> bool:
        seg = self._open
        if seg is None or seg.seq not in self._dead or self.disabled_reason or not self._punch_ok:
            return False  # (without punching, sealing it would free nothing: it is the newest file)
        try:
            self._seal_sync()  # reclaims on success
        except TierUnavailable as e:
            log.warning("SSD tier: cannot seal %s to free its deleted records: %s", seg.path.name, e)
            return False
        return True

    def _reclaim_sync(self) -> None:
        """Free what the rules allow now (module docstring); keep the rest for a later pass."""
        if not self._dead:
            return
        unlinked: list[SegmentState] = []
        punch: list[tuple[SegmentState, list[tuple[int, int]]]] = []
        with self._lock:
            newest = max(self._segments, default=0)
            for seq in list(self._dead):
                seg = self._segments.get(seq)
                if seg is None or seg.dead:
                    del self._dead[seq]
                    continue
                if not seg.sealed:
                    continue
                empty = self._index.live_in(seq) == 0
                # no live record: nothing of it is owed to the object tier (the flusher publishes
                # live records only), so flushed or not it goes once no upload holds it
                if empty and seq != newest and seg.pins == 0:
                    self._evict_locked(seg, [])  # no live key: nothing to pop, no hook to tell
                    del self._dead[seq]
                    unlinked.append(seg)
                    continue
                extents = self._dead[seq]
                if extents and not self._punch_ok:
                    extents = []
                elif extents and seg.readers == 0 and (seg.flushed or not self._flusher_attached):
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
            metrics.USED_BYTES.set(self._used)
        if punch and self._tombstones_durable():
            for seg, extents in punch:
                self._punch(seg, extents)

    def _tombstones_durable(self) -> bool:
        """fdatasync the tombstone log if writes left it unsynced: a punched record must never be
        found live after a crash."""
        if not self._tomb_dirty:
            return True
        try:
            assert self._tomb_fd is not None
            os.fdatasync(self._tomb_fd)
        except OSError as e:
            log.error("SSD tier: cannot sync the tombstone log (%s); deleted records keep their bytes", e)
            return False
        self._tomb_dirty = False
        return True

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
                                "stay until their segment is emptied or evicted", self.rank_dir, e)
                else:
                    log.warning("SSD tier: cannot free deleted records in %s: %s", seg.path.name, e)
                return
            metrics.PUNCHED_BYTES.inc(n)
