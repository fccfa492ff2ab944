"""Offline verification of SSD tier directories (``dtkv fsck DIR``).

Every record of every segment is read and fully verified (header, layer checksums, and the key
the footer says it holds; there is no namespace here, records of any tenant pass). Rules:

* a sealed segment must have a valid footer whose entries tile the data region;
* a record a tombstone names is dead: the tier punches its blocks out (it reads as zeros) and
  never serves it, so one that fails verification is counted as freed, not corrupt;
* a torn last tombstone (a crash) or a damaged one is a warning: recovery drops it, and a
  punched record it named then fails verification here as corruption;
* only the newest segment of a rank directory may lack a footer (open at a crash, or in use by
  a live writer). Failing bytes after its last valid record are a *torn tail*, the expected
  trace of a crash that recovery truncates: a warning, not corruption;
* everything else is *corruption* (exit 1): a damaged record with valid records after it
  (recovery skips it and keeps them), any older segment without a valid footer (truncated or
  damaged: no crash can tear a segment that was sealed), an entry that is not a regular file or
  cannot be read (the tier quarantines it).
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...blocks.codec import MAGIC, verify_record
from ...errors import RecordError
from .quarantine import open_regular
from .recovery import newest_segment, scan_records
from .segment import LOCK_FILE, TOMBSTONE_FILE, TORN, list_segments, read_footer, read_tombstones

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
    records_freed: int = 0  # tombstoned records whose bytes no longer verify (punched out)
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
        dead = _check_tombstones(rank_dir / TOMBSTONE_FILE, report)
        newest = newest_segment(rank_dir)
        for seq, seg_path in list_segments(rank_dir):
            report.segments += 1
            try:
                _check_segment(seg_path, seq, seq == newest, dead, report)
            except OSError as e:
                report.problems.append(Problem(str(seg_path), None, None,
                                               f"cannot read it (the tier quarantines it): {e}", True))
    return report


def _check_tombstones(path: Path, report: FsckReport) -> set[tuple[int, int]]:
    """Dead ``(seq, offset)`` locations the tombstone log names."""
    def bad(at: int, why: str) -> None:
        error = "torn last tombstone" if why == TORN else "damaged tombstone"
        report.problems.append(Problem(str(path), at, None, error + " (ignored by recovery)", False))

    try:
        tombs = read_tombstones(path, bad)
    except OSError as e:
        report.problems.append(Problem(str(path), None, None, f"cannot read it (the tier quarantines it, so "
                                       f"deleted records may come back): {e}", True))
        return set()
    report.tombstones += len(tombs)
    return {(s, o) for s, o, _ in tombs}


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


def _check_segment(path: Path, seq: int, newest: bool, dead: set[tuple[int, int]], report: FsckReport) -> None:
    fd = open_regular(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        footer = read_footer(fd, size)
        if footer is None or footer.seq != seq:
            report.unsealed += 1
            _check_scanned(fd, size, path, newest, report)
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
                if (seq, off) in dead:  # deleted, its blocks freed: never served, not corruption
                    report.records_freed += 1
                    continue
                report.problems.append(Problem(str(path), off, key.hex(), f"{type(e).__name__}: {e}", True))
                continue
            report.records_ok += 1
            report.bytes_verified += length
        if expect != footer.data_bytes:
            report.problems.append(Problem(str(path), expect, None, "data region not covered by the footer", True))
    finally:
        os.close(fd)


def _check_scanned(fd: int, size: int, path: Path, newest: bool, report: FsckReport) -> None:
    """A segment without a valid footer: scan it the way recovery does and classify what fails."""
    scan = scan_records(fd, size)
    report.records_ok += len(scan.entries)
    report.bytes_verified += sum(n for _, _, n in scan.entries)
    for off, n, why in scan.damaged:
        report.problems.append(Problem(str(path), off, _key_at(fd, off), f"{why}; a valid record follows at "
                                       f"offset {off + n} (recovery skips the damaged bytes and keeps it)", True))
    if not newest:
        tail = f"; damaged from offset {scan.end}: {scan.tail_why}" if scan.tail_why else ""
        report.problems.append(Problem(str(path), scan.end if scan.tail_why else None, None,
                                       "not the newest segment of its rank, yet no valid footer: truncated or "
                                       f"damaged, not a torn tail (recovery rebuilds the footer, cuts nothing){tail}",
                                       True))
    elif scan.tail_why:
        report.problems.append(Problem(str(path), scan.end, _key_at(fd, scan.end), f"torn tail of "
                                       f"{size - scan.end} bytes in the newest, unsealed segment (recovery "
                                       f"truncates it): {scan.tail_why}", False))


def _key_at(fd: int, off: int) -> str | None:
    head = os.pread(fd, 64, off)
    if head[:8] != MAGIC or len(head) < 48:
        return None
    return head[32:48].hex()  # the (unverified) key field of the record header, docs/FORMAT.md
