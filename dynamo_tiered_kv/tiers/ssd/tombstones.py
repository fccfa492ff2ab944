"""The tombstone log while the tier runs: appends, and compaction once dead entries dominate.

A tombstone names a dead location ``(seq, offset)`` of a segment (docs/SSD.md section 3). It
matters only while that segment's file can come back at a restart; once the segment is gone
(evicted, or emptied and unlinked) its tombstones are dead weight: 40 B per delete or
overwrite for the life of the process, and parsed at the next start. Start-up drops them
(``recovery.load_tombstones``); a long-running tier drops them here, on the writer thread, when
the log has grown past ``max(COMPACT_MIN_BYTES, COMPACT_RATIO x its live entries)``. Each
compaction keeps at most a quarter of what it reads, so its cost per appended tombstone is
bounded, and the log stays below that bound (plus one batch) for as long as the tier runs.

Crash safety, the same rewrite as at start (``write_log``): the kept entries go to
``tombstones.tmp``, which is fsynced and renamed over the log, then the directory is fsynced.
A crash before the rename leaves the old log, a superset of the new one (start-up removes the
stale temp file); after it, the new log. The append descriptor is opened on the temp file
before the rename, so it follows the new file: no tombstone is ever appended to the replaced
one. A segment's tombstones are dropped only when its file is absent and the directory was
fsynced after that: a segment whose unlink had not reached the disk could otherwise come back
at a restart with its deleted records and nothing to hide them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .._fileio import fsync_dir
from .quarantine import open_regular, read_regular
from .segment import TOMBSTONE, TOMBSTONE_FILE, append_tombstones, pack_tombstone, parse_tombstones, segment_name

if TYPE_CHECKING:
    from .state import SegmentLogState

log = logging.getLogger(__name__)

TOMBSTONE_TMP = "tombstones.tmp"
#: the log is never compacted below this size: rewriting a small log saves little
COMPACT_MIN_BYTES = 1 << 20
#: the log is compacted once it holds this many times its live entries
COMPACT_RATIO = 4

Entry = tuple[int, int, bytes]  # (seq, offset, key)


def kept_entries(raw: bytes, keep: Callable[[int], bool]) -> list[Entry]:
    """Intact entries of the log bytes ``raw`` whose segment ``keep`` keeps, each location once,
    in log order (damaged and torn entries dropped, as every reader does)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for s, o, k in parse_tombstones(raw):
        if (s, o) not in seen and keep(s):
            seen.add((s, o))
            out.append((s, o, k))
    return out


def write_log(rank_dir: Path, entries: Iterable[Entry]) -> int:
    """Replace the log with ``entries``: temp file, fsync, rename, fsync the directory.

    Returns an ``O_APPEND`` descriptor of the new log (the caller owns it). Raises ``OSError``
    when the new log could not replace the old one; the old log is then untouched and the temp
    file removed. Once renamed, a failed directory fsync is only logged: the rename has happened
    and the new log is the one to append to.
    """
    tmp = rank_dir / TOMBSTONE_TMP
    data = b"".join(pack_tombstone(s, o, k) for s, o, k in entries)
    fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
    try:
        n = os.write(fd, data) if data else 0
        if n != len(data):
            raise OSError(errno.ENOSPC, f"short write to {tmp.name} ({n} of {len(data)} bytes)")
        os.fsync(fd)
        os.replace(tmp, rank_dir / TOMBSTONE_FILE)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        fsync_dir(rank_dir)
    except OSError as e:  # renamed already: the new log is the current one, durable or not
        log.warning("SSD tier: cannot sync %s after rewriting the tombstone log: %s", rank_dir, e)
    return fd


def remove_stale_tmp(rank_dir: Path) -> None:
    """Remove a temp log a crash left behind (never authoritative: the rename did not happen)."""
    try:
        (rank_dir / TOMBSTONE_TMP).unlink(missing_ok=True)
    except OSError as e:
        log.warning("SSD tier: cannot remove a stale %s: %s", TOMBSTONE_TMP, e)


class TombstoneLog:
    """Appends to the tombstone log and compacts it (module docstring).

    Built by ``SSDTier`` with the shared ``SegmentLogState`` (rank directory, ``fsync``, and the
    segment table, asked for membership only). Threads: the writer thread only (``append``
    trims a torn tail, compaction replaces the file: one appender), opening and closing included.
    """

    def __init__(self, state: SegmentLogState) -> None:
        self._state = state
        self._rank_dir = state.rank_dir
        self._fd: int | None = None
        self._dirty = False  # tombstones written but not yet fdatasynced (fsync=False)
        self._bytes = 0  # the log's size as appended (whole entries)
        #: seq -> entries naming it in the log (what compaction would keep while it exists)
        self._per_seq: Counter[int] = Counter()
        self._check_at = COMPACT_MIN_BYTES  # log size at which to consider compacting

    def note_recovered(self, dead: Iterable[tuple[int, int]]) -> None:
        """Recovery's dead locations (``load_tombstones``): the entries of the log it compacted."""
        self._per_seq = Counter(s for s, _ in dead)

    def open(self) -> None:
        """Open the log for appends, after recovery."""
        path = self._rank_dir / TOMBSTONE_FILE
        try:
            self._fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            size = os.fstat(self._fd).st_size
        except OSError as e:  # serve and write anyway; deletes then last until the next restart only
            log.error("SSD tier: cannot open %s (%s): deletes and overwrites are not recorded durably", path, e)
            return
        self._bytes = size - size % TOMBSTONE.size
        self._plan_compaction(sum(self._per_seq.values()))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def append(self, locs: list[Entry]) -> bool:
        """Append tombstones for ``locs``; whether they were written (synced when ``fsync``).
        Then compacts the log if this append took it past its bound."""
        if self._fd is None:
            return False
        try:
            append_tombstones(self._fd, b"".join(pack_tombstone(s, o, k) for s, o, k in locs))
            if self._state.fsync:
                os.fdatasync(self._fd)
            else:
                self._dirty = True
        except OSError as e:  # the key is gone from memory; after a restart it may come back (still valid)
            log.error("SSD tier: cannot record %d tombstones: %s", len(locs), e)
            return False
        self._bytes += len(locs) * TOMBSTONE.size
        self._per_seq.update(s for s, _, _ in locs)
        if self._bytes >= self._check_at:
            self._compact()
        return True

    def make_durable(self) -> bool:
        """fdatasync the log if appends left it unsynced (``fsync=False``); whether every
        tombstone written is durable now. A punched record must never be found live after a crash."""
        if not self._dirty:
            return True
        try:
            assert self._fd is not None
            os.fdatasync(self._fd)
        except OSError as e:
            log.error("SSD tier: cannot sync the tombstone log (%s); deleted records keep their bytes", e)
            return False
        self._dirty = False
        return True

    def _segment_exists(self, seq: int) -> bool:
        """Whether segment ``seq`` is served or its file is still there (it could come back)."""
        return seq in self._state.segments or os.path.lexists(self._rank_dir / segment_name(seq))

    def _plan_compaction(self, live_entries: int) -> None:
        self._check_at = max(COMPACT_MIN_BYTES, COMPACT_RATIO * live_entries * TOMBSTONE.size) + TOMBSTONE.size

    def _compact(self) -> bool:
        """Rewrite the log without the entries of segments that are gone, if they dominate it.
        Returns whether it rewrote the log. Never raises: the old log stays valid."""
        assert self._fd is not None
        exists = {s: self._segment_exists(s) for s in self._per_seq}
        live = sum(c for s, c in self._per_seq.items() if exists[s])
        if self._bytes <= max(COMPACT_MIN_BYTES, COMPACT_RATIO * live * TOMBSTONE.size):
            self._plan_compaction(live)
            return False
        before = self._bytes

        def keep(seq: int) -> bool:  # the log may name seqs appended before this process started
            if seq not in exists:
                exists[seq] = self._segment_exists(seq)
            return exists[seq]

        try:
            fsync_dir(self._rank_dir)  # the unlinks of gone segments are durable before their tombstones go
            kept = kept_entries(read_regular(self._rank_dir / TOMBSTONE_FILE), keep)
            fd = write_log(self._rank_dir, kept)
        except OSError as e:
            log.warning("SSD tier: cannot compact the tombstone log (%s); it stays as it is", e)
            self._check_at = 2 * self._bytes  # not again at every append
            return False
        old, self._fd = self._fd, fd
        with contextlib.suppress(OSError):  # the replaced file: nothing is appended to it any more
            os.close(old)
        self._dirty = False  # everything kept was fsynced with the new file
        self._bytes = len(kept) * TOMBSTONE.size
        self._per_seq = Counter(s for s, _, _ in kept)
        self._plan_compaction(len(kept))
        log.info("SSD tier %s: compacted the tombstone log from %d to %d entries", self._rank_dir,
                 before // TOMBSTONE.size, len(kept))
        return True
