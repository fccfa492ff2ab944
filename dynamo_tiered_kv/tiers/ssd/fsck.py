"""Offline verification of SSD tier directories (``dtkv fsck DIR``).

Every record of every segment is read and fully verified (header, layer checksums, and the key
the footer says it holds). Sealed segments must have a valid footer whose entries tile the data
region; an unsealed segment (open at a crash, or in use by a live writer) is scanned instead.
A failing record is *corruption* when valid records follow it (recovery would lose them); a
failing tail with nothing valid after it is a *torn tail*, the expected trace of a crash, which
recovery truncates: a warning, not corruption.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...codec import ALIGN, MAGIC, decode_header, verify_record
from ...errors import RecordError
from .recovery import scan_records
from .segment import LOCK_FILE, TOMBSTONE, TOMBSTONE_FILE, list_segments, parse_tombstones, read_footer

_RANK_RE = re.compile(r"^rank-\d+$")


@dataclass
class Problem:
    segment: str
    offset: int | None
    key: str | None
    error: str
    corrupt: bool  # False: a warning (torn tail, in-use directory)


@dataclass
class FsckReport:
    rank_dirs: int = 0
    segments: int = 0
    sealed: int = 0
    unsealed: int = 0
    records_ok: int = 0
    bytes_verified: int = 0
    tombstones: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def corrupt(self) -> list[Problem]:
        return [p for p in self.problems if p.corrupt]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["corrupt_count"] = len(self.corrupt)
        return d


def rank_dirs_of(path: Path) -> list[Path]:
    """``path`` itself when it holds segments, else its ``rank-*`` subdirectories."""
    if list_segments(path) or (path / LOCK_FILE).exists():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_dir() and _RANK_RE.match(p.name))


def fsck_dir(path: Path) -> FsckReport:
    """Verify every segment under ``path`` (a tier root or one rank directory)."""
    report = FsckReport()
    for rank_dir in rank_dirs_of(path):
        report.rank_dirs += 1
        if _in_use(rank_dir):
            report.problems.append(Problem(str(rank_dir), None, None,
                                           "in use by a live writer: its open segment may look torn", False))
        for _seq, seg_path in list_segments(rank_dir):
            report.segments += 1
            _check_segment(seg_path, report)
        raw = (rank_dir / TOMBSTONE_FILE).read_bytes() if (rank_dir / TOMBSTONE_FILE).exists() else b""
        report.tombstones += len(parse_tombstones(raw))
        if len(raw) % TOMBSTONE.size:
            report.problems.append(Problem(str(rank_dir / TOMBSTONE_FILE), None, None,
                                           "torn last tombstone (ignored by recovery)", False))
    return report


def _in_use(rank_dir: Path) -> bool:
    try:
        fd = os.open(rank_dir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _check_segment(path: Path, report: FsckReport) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        footer = read_footer(fd, size)
        if footer is None:
            report.unsealed += 1
            _check_unsealed(fd, size, path, report)
            return
        report.sealed += 1
        expect = 0
        for key, off, length in zip(footer.entries["key"].tolist(), footer.entries["offset"].tolist(),
                                    footer.entries["length"].tolist()):
            if off != expect:
                report.problems.append(Problem(str(path), expect, None,
                                               f"{off - expect} bytes not covered by the footer index", True))
            expect = off + length
            try:
                verify_record(os.pread(fd, length, off), key=key)
            except RecordError as e:
                report.problems.append(Problem(str(path), off, key.hex(), f"{type(e).__name__}: {e}", True))
                continue
            report.records_ok += 1
            report.bytes_verified += length
        if expect != footer.data_bytes:
            report.problems.append(Problem(str(path), expect, None, "data region not covered by the footer", True))
    finally:
        os.close(fd)


def _check_unsealed(fd: int, size: int, path: Path, report: FsckReport) -> None:
    entries, end, why = scan_records(fd, size)
    report.records_ok += len(entries)
    report.bytes_verified += end
    if end == size:
        return
    key = _key_at(fd, end)
    later = _next_valid_record(fd, end + ALIGN, size)
    if later is None:
        report.problems.append(Problem(str(path), end, key, f"torn tail of {size - end} bytes in an unsealed "
                                       f"segment (recovery truncates it): {why}", False))
    else:
        report.problems.append(Problem(str(path), end, key, f"{why}; a valid record follows at offset {later}",
                                       True))


def _key_at(fd: int, off: int) -> str | None:
    head = os.pread(fd, 64, off)
    if head[:8] != MAGIC or len(head) < 48:
        return None
    return head[32:48].hex()  # the (unverified) key field of the record header, docs/FORMAT.md


def _next_valid_record(fd: int, start: int, size: int) -> int | None:
    off = start - start % ALIGN
    while off + ALIGN <= size:
        head = os.pread(fd, ALIGN, off)
        if head[:8] == MAGIC:
            try:
                (hb,) = struct.unpack_from("<I", head, 12)
                hdr = decode_header(os.pread(fd, max(hb, ALIGN), off))
                verify_record(os.pread(fd, hdr.record_bytes, off))
                return off
            except (RecordError, struct.error):
                pass
        off += ALIGN
    return None
