"""Filesystem space of segment files: punch a hole, measure what a file or a byte range holds.

Blocking syscalls only (Linux). ``fallocate(PUNCH_HOLE | KEEP_SIZE)`` frees the filesystem blocks
of a byte range and keeps the file size, so the range reads back as zeros and every offset after
it stays valid. Python's ``os`` has no ``fallocate`` with a mode, hence ctypes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
#: errnos that mean "this filesystem (or kernel) cannot punch holes", not "this call failed"
UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS})

_fallocate: Callable[[int, int, int, int], int] | None = None


def _libc_fallocate() -> Callable[[int, int, int, int], int]:
    global _fallocate
    if _fallocate is None:
        if not sys.platform.startswith("linux"):
            raise OSError(errno.EOPNOTSUPP, "hole punching needs Linux fallocate(2)")
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int
        _fallocate = fn
    return _fallocate


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``[offset, offset + length)`` of ``fd``'s file, keeping its size.

    Raises:
        OSError: ``errno`` in ``UNSUPPORTED`` when the filesystem cannot punch holes.
    """
    if length <= 0:
        return
    if _libc_fallocate()(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fallocate(PUNCH_HOLE) at {offset}+{length}: {os.strerror(e)}")


def whole_blocks(extents: Iterable[tuple[int, int]], block: int) -> list[tuple[int, int]]:
    """Merge ``(offset, length)`` extents that touch, then shrink each to the whole ``block``-sized
    filesystem blocks inside it (a partial block may hold a neighbour's bytes). Empty ones go."""
    out: list[tuple[int, int]] = []
    merged: list[list[int]] = []
    for off, n in sorted(extents):
        if merged and off <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], off + n)
        else:
            merged.append([off, off + n])
    for start, end in merged:
        lo, hi = -(-start // block) * block, end // block * block
        if hi > lo:
            out.append((lo, hi - lo))
    return out


def allocated_bytes(path: Path) -> int:
    """Bytes the filesystem holds for ``path`` (``st_blocks * 512``); 0 when it is gone."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def allocated_in(fd: int, offset: int, length: int) -> int:
    """Bytes of ``[offset, offset + length)`` that hold data rather than a hole (SEEK_DATA/SEEK_HOLE;
    filesystems without them report the whole range as data)."""
    end, pos, held = offset + length, offset, 0
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole up to the end of the file
                return held
            raise
        if data >= end:
            return held
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        held += hole - data
        pos = hole
    return held
