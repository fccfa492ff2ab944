"""What an SSD tier directory holds on disk: allocated bytes, overall and per record.

For benchmarks, tests and operators; reads only (a live tier may be writing meanwhile, so a
directory in use gives a snapshot, not a consistent cut). Records are located through each
segment's footer, or by scanning a segment that has none (the open one).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path

from .fsck import rank_dirs_of
from .holes import allocated_bytes, allocated_in
from .recovery import scan_records
from .segment import TOMBSTONE_FILE, list_segments, read_footer, read_tombstones


def segment_files(root: Path) -> Iterator[Path]:
    """Every segment file under ``root`` (a tier root or one rank directory)."""
    for rank_dir in rank_dirs_of(root):
        for _, path in list_segments(rank_dir):
            yield path


def allocated_segment_bytes(root: Path) -> int:
    """Bytes the filesystem holds for all segment files under ``root`` (``st_blocks * 512``)."""
    return sum(allocated_bytes(p) for p in segment_files(root))


def bytes_held_by(root: Path, keys: Collection[bytes], *, dead: bool = False) -> int:
    """Allocated bytes inside the records the segment files under ``root`` still contain, of
    ``keys`` (any copy, live or dead) and, with ``dead``, of every location the tombstone log
    names (deleted or overwritten records); each record counts once, a punched one 0."""
    held = 0
    for rank_dir in rank_dirs_of(root):
        tombs = _tombstoned(rank_dir) if dead else set()
        for seq, path in list_segments(rank_dir):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # unlinked meanwhile
                continue
            try:
                size = os.fstat(fd).st_size
                footer = read_footer(fd, size)
                if footer is not None:
                    ent = footer.entries
                    extents = zip(ent["key"].tolist(), ent["offset"].tolist(), ent["length"].tolist())
                else:
                    extents = iter(scan_records(fd, size).entries)
                held += sum(allocated_in(fd, off, n) for key, off, n in extents
                            if key in keys or (seq, off) in tombs)
            finally:
                os.close(fd)
    return held


def _tombstoned(rank_dir: Path) -> set[tuple[int, int]]:
    return {(s, o) for s, o, _ in read_tombstones(rank_dir / TOMBSTONE_FILE)}  # bad entries name nothing
