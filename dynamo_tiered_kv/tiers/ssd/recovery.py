"""Rebuild a rank directory's state after a restart or a crash.

Sealed segments are trusted through their footer (trailer and entry checksums). A segment
without a valid footer is scanned and every record fully verified; a record that fails is
skipped and the scan resyncs on the next valid header (records are 4 KiB aligned and
self-describing), so one damaged record never costs the valid ones after it. Only the newest
segment can have been open at a crash: bytes after its last valid record are a torn tail and are
truncated; any older segment was sealed once, so nothing of it is cut and its footer is rebuilt
after everything the file holds. Damage is logged and counted (``dtkv_ssd_damaged_records``).
A segment that cannot be opened or read is quarantined (``quarantine.py``), not fatal.
Tombstones then hide dead locations.

Each record's tenant (its header's tenant field, for the tenant ledger) comes from the scan, or,
for a segment trusted through its footer, from the headers themselves: one read of the first
record that is still there when the footer says the segment holds one tenant (``ONE_TENANT``),
one read of 8 bytes per record otherwise (segments sealed before the flag existed, and segments
holding several tenants). A punched (deleted) record reads as zeros and is named the default
tenant; its tombstone keeps it out of the index anyway.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...blocks.codec import ALIGN, MAGIC, align_up, decode_header, record_tenant, verify_record
from ...blocks.tenant import DEFAULT_TENANT
from ...errors import RecordError
from .._fileio import fsync_dir
from . import metrics
from .quarantine import is_regular, open_regular, quarantine, read_regular
from .segment import (
    ENTRY_DTYPE,
    ONE_TENANT,
    TOMBSTONE,
    TOMBSTONE_FILE,
    Footer,
    build_footer,
    flushed_marker,
    list_segments,
    read_footer,
)
from .tombstones import kept_entries, remove_stale_tmp, write_log

log = logging.getLogger(__name__)
_MAX_HEADER = 1 << 20

__all__ = ["RecoveredSegment", "ScanResult", "entry_tenants", "fsync_dir", "load_tombstones", "newest_segment",
           "recover_segments", "scan_records", "seal_file"]


@dataclass
class RecoveredSegment:
    seq: int
    path: Path
    size: int  # file bytes, footer included
    data_bytes: int
    sealed_at_ns: int
    entries: np.ndarray  # ENTRY_DTYPE
    flushed: bool
    tenants: list[bytes]  # the tenant of each entry
    truncated_bytes: int = 0  # torn tail removed by this recovery
    seal_error: str | None = None  # the footer could not be written (full or read-only disk)


@dataclass
class ScanResult:
    entries: list[tuple[bytes, int, int]] = field(default_factory=list)  # (key, offset, length), file order
    tenants: list[bytes] = field(default_factory=list)  # the tenant of each entry
    damaged: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, length, why) between valid records
    end: int = 0  # end of the last valid record
    tail_why: str | None = None  # why the bytes from ``end`` on are not records (None: ``end`` is the file size)


def _record_at(fd: int, off: int, size: int) -> tuple[bytes | None, int, str, bytes]:
    """(key, length, "", tenant) of the valid record at ``off``, else (None, bytes to skip, why, _)."""
    head = os.pread(fd, ALIGN, off)
    if head[:8] != MAGIC:
        return None, ALIGN, f"no record at offset {off}", DEFAULT_TENANT
    try:
        (hb,) = struct.unpack_from("<I", head, 12)
        if ALIGN < hb <= _MAX_HEADER:
            head = os.pread(fd, hb, off)
        hdr = decode_header(head)
    except (RecordError, struct.error) as e:
        return None, ALIGN, f"bad header at offset {off}: {e}", DEFAULT_TENANT
    if off + hdr.record_bytes > size:
        return None, ALIGN, f"record at offset {off} ends past the file (torn)", DEFAULT_TENANT
    try:
        verify_record(os.pread(fd, hdr.record_bytes, off))
    except RecordError as e:  # the header checksum passed, so its length is trustworthy: skip it whole
        return None, hdr.record_bytes, f"record at offset {off}: {type(e).__name__}: {e}", DEFAULT_TENANT
    return hdr.key, hdr.record_bytes, "", hdr.tenant


def scan_records(fd: int, size: int) -> ScanResult:
    """Verify every record; skip damaged ones and resync on the next valid header."""
    r = ScanResult()
    off = 0
    bad: tuple[int, str] | None = None  # start and reason of the damaged run being skipped
    while off + ALIGN <= size:
        key, n, why, tenant = _record_at(fd, off, size)
        if key is None:
            bad = bad or (off, why)
            off += n
            continue
        if bad is not None:
            r.damaged.append((bad[0], off - bad[0], bad[1]))
            bad = None
        r.entries.append((key, off, n))
        r.tenants.append(tenant)
        off += n
        r.end = off
    if bad is not None:
        r.tail_why = bad[1]
    elif r.end != size:
        r.tail_why = f"{size - r.end} trailing bytes at offset {r.end}"
    return r


def newest_segment(rank_dir: Path) -> int | None:
    """Seq of the newest segment file: the only one a crash can have left open (torn)."""
    regular = [seq for seq, path in list_segments(rank_dir) if is_regular(path)]
    return regular[-1] if regular else None


def seal_file(fd: int, rank: int, seq: int, entries: list[tuple[bytes, int, int]], data_bytes: int,
              flags: int = 0) -> Footer:
    """Truncate (or extend) to ``data_bytes`` and append a footer (buffered write + fdatasync)."""
    now = time.time_ns()
    os.ftruncate(fd, data_bytes)
    footer = build_footer(rank, seq, data_bytes, now, entries, flags=flags)
    os.pwrite(fd, footer.tobytes(), data_bytes)
    os.fdatasync(fd)
    table = np.array([(k, o, n, 0) for k, o, n in entries], dtype=ENTRY_DTYPE)
    return Footer(rank, seq, data_bytes, now, table, flags)


def entry_tenants(fd: int, entries: np.ndarray, one_tenant: bool) -> list[bytes]:
    """The tenant of each footer entry, read from the records' headers (module docstring)."""
    offsets = entries["offset"].tolist()
    if not one_tenant:
        return [_tenant_at(fd, off) for off in offsets]
    for off in offsets:  # the first record still there (a deleted one may be punched to zeros)
        head = os.pread(fd, 120, off)
        if head[:8] == MAGIC:
            return [record_tenant(head)] * len(offsets)
    return [DEFAULT_TENANT] * len(offsets)


def _tenant_at(fd: int, off: int) -> bytes:
    return record_tenant(os.pread(fd, 120, off))


def recover_segments(rank_dir: Path, rank: int) -> list[RecoveredSegment]:
    """Sealed and resealed segments of ``rank_dir``, oldest first (see module docstring).

    A segment that cannot be opened or read (not a regular file, I/O error) is quarantined.
    """
    out: list[RecoveredSegment] = []
    newest = newest_segment(rank_dir)
    for seq, path in list_segments(rank_dir):
        try:
            r = _recover_one(path, seq, rank, newest=seq == newest)
        except OSError as e:
            quarantine(path, f"cannot read it: {e}")
            continue
        if r is not None:
            out.append(r)
    return out


def _recover_one(path: Path, seq: int, rank: int, *, newest: bool) -> RecoveredSegment | None:
    fd = open_regular(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        footer = read_footer(fd, size)
        if footer is not None and footer.seq == seq:
            return RecoveredSegment(seq, path, size, footer.data_bytes, footer.sealed_at_ns, footer.entries,
                                    flushed_marker(path).exists(),
                                    entry_tenants(fd, footer.entries, bool(footer.flags & ONE_TENANT)))
        scan = scan_records(fd, size)
        for off, n, why in scan.damaged:
            log.error("SSD recovery: %s: skipping %d damaged bytes at offset %d (%s); the valid records after "
                      "them are kept", path.name, n, off, why)
            metrics.DAMAGED_RECORDS.inc()
        truncated = 0
        if newest:  # the open segment at a crash: what follows its last valid record is a torn tail
            if not scan.entries:
                log.warning("SSD recovery: %s holds no whole record (%s); removing it", path.name, scan.tail_why)
                path.unlink()
                flushed_marker(path).unlink(missing_ok=True)
                metrics.TORN_TAIL_BYTES.inc(size)
                return None
            data_bytes = scan.end
            truncated = size - scan.end
            if truncated:
                log.warning("SSD recovery: %s: truncating %d-byte torn tail (%s)", path.name, truncated,
                            scan.tail_why)
                metrics.TORN_TAIL_BYTES.inc(truncated)
        else:  # sealed once, so no crash tore it: damage, never cut; the footer goes after all of it
            if not scan.entries:
                raise OSError(errno.EIO, f"older segment without a footer holds no valid record ({scan.tail_why})")
            log.error("SSD recovery: %s is not the newest segment but has no valid footer; rebuilding it after "
                      "all %d bytes%s", path.name, size, f" (damaged from offset {scan.end}: {scan.tail_why})"
                      if scan.tail_why else "")
            if scan.tail_why:
                metrics.DAMAGED_RECORDS.inc()
            data_bytes = align_up(size, ALIGN)
        flags = ONE_TENANT if len(set(scan.tenants)) == 1 else 0
        try:
            footer = seal_file(fd, rank, seq, scan.entries, data_bytes, flags)
        except OSError as e:  # serve the verified records anyway; the file stays unsealed
            log.error("SSD recovery: cannot seal %s: %s", path.name, e)
            table = np.array([(k, o, n, 0) for k, o, n in scan.entries], dtype=ENTRY_DTYPE)
            return RecoveredSegment(seq, path, os.fstat(fd).st_size, data_bytes, 0, table,
                                    flushed_marker(path).exists(), scan.tenants, truncated, str(e))
        return RecoveredSegment(seq, path, data_bytes + footer.footer_bytes, footer.data_bytes,
                                footer.sealed_at_ns, footer.entries, flushed_marker(path).exists(), scan.tenants,
                                truncated)
    finally:
        os.close(fd)


def load_tombstones(rank_dir: Path, live_seqs: set[int]) -> set[tuple[int, int]]:
    """Dead (seq, offset) locations; compacts the log to the segments that still exist (each
    location once) and removes a temp log a crash left behind (``tombstones.py``)."""
    remove_stale_tmp(rank_dir)
    path = rank_dir / TOMBSTONE_FILE
    try:
        raw = read_regular(path)
    except FileNotFoundError:
        return set()
    except OSError as e:  # deleted or superseded copies may come back: still valid records of their keys
        quarantine(path, f"cannot read the tombstone log: {e}")
        return set()
    kept = kept_entries(raw, live_seqs.__contains__)
    if len(kept) * TOMBSTONE.size != len(raw):
        try:
            os.close(write_log(rank_dir, kept))
        except OSError as e:  # compaction is an optimisation; the old log stays valid
            log.warning("SSD recovery: cannot compact %s: %s", path, e)
    return {(s, o) for s, o, _ in kept}
