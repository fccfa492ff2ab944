"""Rebuild a rank directory's state after a restart or a crash.

Sealed segments are trusted through their footer (trailer and entry checksums). A segment
without a valid footer was open at the crash: its records are scanned and fully verified from
offset 0, the first one that does not verify (or ends past the file) marks the torn tail, the
file is truncated there and sealed, so nothing half-written ever becomes visible. An unsealed
segment with no whole record is removed. Tombstones then hide dead locations.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..._fileio import fsync_dir
from ...codec import ALIGN, MAGIC, decode_header, verify_record
from ...errors import RecordError
from . import metrics
from .segment import (
    ENTRY_DTYPE,
    TOMBSTONE,
    TOMBSTONE_FILE,
    Footer,
    build_footer,
    flushed_marker,
    list_segments,
    pack_tombstone,
    parse_tombstones,
    read_footer,
)

log = logging.getLogger(__name__)
_MAX_HEADER = 1 << 20


@dataclass
class RecoveredSegment:
    seq: int
    path: Path
    size: int  # file bytes, footer included
    data_bytes: int
    sealed_at_ns: int
    entries: np.ndarray  # ENTRY_DTYPE
    flushed: bool
    truncated_bytes: int = 0  # torn tail removed by this recovery
    seal_error: str | None = None  # the footer could not be written (full or read-only disk)


def scan_records(fd: int, size: int) -> tuple[list[tuple[bytes, int, int]], int, str | None]:
    """Verify records from offset 0 until one fails. Returns (entries, end of the last good one, why)."""
    entries: list[tuple[bytes, int, int]] = []
    off = 0
    while off + ALIGN <= size:
        head = os.pread(fd, ALIGN, off)
        if head[:8] != MAGIC:
            return entries, off, f"no record at offset {off}"
        (hb,) = struct.unpack_from("<I", head, 12)
        try:
            if ALIGN < hb <= _MAX_HEADER:
                head = os.pread(fd, hb, off)
            hdr = decode_header(head)
        except RecordError as e:
            return entries, off, f"bad header at offset {off}: {e}"
        if off + hdr.record_bytes > size:
            return entries, off, f"record at offset {off} ends past the file (torn)"
        try:
            verify_record(os.pread(fd, hdr.record_bytes, off))
        except RecordError as e:
            return entries, off, f"record at offset {off}: {e}"
        entries.append((hdr.key, off, hdr.record_bytes))
        off += hdr.record_bytes
    return entries, off, None if off == size else f"{size - off} trailing bytes at offset {off}"


def seal_file(fd: int, rank: int, seq: int, entries: list[tuple[bytes, int, int]], data_bytes: int) -> Footer:
    """Truncate at ``data_bytes`` and append a footer (buffered write + fdatasync)."""
    now = time.time_ns()
    os.ftruncate(fd, data_bytes)
    footer = build_footer(rank, seq, data_bytes, now, entries)
    os.pwrite(fd, footer.tobytes(), data_bytes)
    os.fdatasync(fd)
    table = np.array([(k, o, n, 0) for k, o, n in entries], dtype=ENTRY_DTYPE)
    return Footer(rank, seq, data_bytes, now, table)


def recover_segments(rank_dir: Path, rank: int) -> list[RecoveredSegment]:
    """Sealed and resealed segments of ``rank_dir``, oldest first (see module docstring)."""
    out: list[RecoveredSegment] = []
    for seq, path in list_segments(rank_dir):
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            footer = read_footer(fd, size)
            truncated = 0
            if footer is None or footer.seq != seq:
                entries, end, why = scan_records(fd, size)
                truncated = size - end
                if not entries:
                    log.warning("SSD recovery: %s holds no whole record (%s); removing it", path.name, why)
                    path.unlink()
                    flushed_marker(path).unlink(missing_ok=True)
                    metrics.TORN_TAIL_BYTES.inc(size)
                    continue
                if truncated:
                    log.warning("SSD recovery: %s: truncating %d-byte torn tail (%s)", path.name, truncated, why)
                    metrics.TORN_TAIL_BYTES.inc(truncated)
                try:
                    footer = seal_file(fd, rank, seq, entries, end)
                    size = end + footer.footer_bytes
                except OSError as e:  # serve the verified records anyway; the file stays unsealed
                    log.error("SSD recovery: cannot seal %s: %s", path.name, e)
                    table = np.array([(k, o, n, 0) for k, o, n in entries], dtype=ENTRY_DTYPE)
                    out.append(RecoveredSegment(seq, path, os.fstat(fd).st_size, end, 0, table,
                                                flushed_marker(path).exists(), truncated, str(e)))
                    continue
        finally:
            os.close(fd)
        out.append(RecoveredSegment(seq, path, size, footer.data_bytes, footer.sealed_at_ns, footer.entries,
                                    flushed_marker(path).exists(), truncated))
    return out


def load_tombstones(rank_dir: Path, live_seqs: set[int]) -> set[tuple[int, int]]:
    """Dead (seq, offset) locations; compacts the log to the segments that still exist."""
    path = rank_dir / TOMBSTONE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return set()
    kept = [(s, o, k) for s, o, k in parse_tombstones(raw) if s in live_seqs]
    if len(kept) * TOMBSTONE.size != len(raw):
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(b"".join(pack_tombstone(s, o, k) for s, o, k in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(rank_dir)
        except OSError as e:  # compaction is an optimisation; the old log stays valid
            log.warning("SSD recovery: cannot compact %s: %s", path, e)
            tmp.unlink(missing_ok=True)
    return {(s, o) for s, o, _ in kept}


