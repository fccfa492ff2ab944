"""Segment files, their footer, and the tombstone log (byte format: docs/SSD.md).

A segment is ``seg-<seq>.dtkv`` in a rank directory: codec records appended back to back from
offset 0 (each a 4 KiB multiple), then, once sealed, a footer padded to 4 KiB::

    entries   n x 32 B   key[16] | offset u64 | length u32 | reserved u32
    zeros     pad so that entries + trailer is a multiple of 4096
    trailer   64 B       magic "DTKVSEG\\0" | version u16 | flags u16 | rank u32 | seq u64 |
                         n_entries u32 | footer_bytes u32 | data_bytes u64 | sealed_at_ns u64 |
                         entries_xxh3 u64 | trailer_xxh3 u64 (of the 56 bytes before it)

Trailer flag ``ONE_TENANT`` (bit 0): every record of the segment names the same tenant in its
header, so recovery reads one header for the segment's tenant instead of one per record.

The trailer is the file's last 64 bytes, so a reader finds the index with one read of the
file's last page. An unsealed segment has no footer; recovery scans its records instead.

Tombstones (``tombstones.log``) are 40-byte entries ``seq u64 | offset u64 | key[16] |
xxh3 u64`` naming a *location* that is dead (deleted or superseded), so a later rewrite of the
same key at another location is unaffected. A torn last entry is ignored.
"""

from __future__ import annotations

import errno
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ...blocks.codec import ALIGN, align_up
from ...blocks.keys import KEY_BYTES
from .quarantine import read_regular

SEG_MAGIC = b"DTKVSEG\x00"
SEG_VERSION = 1
#: trailer flag: every record of the segment names one tenant (docs/SSD.md section 2)
ONE_TENANT = 1
ENTRY = struct.Struct(f"<{KEY_BYTES}sQII")
TRAILER = struct.Struct("<8sHHIQIIQQQQ")
TOMBSTONE = struct.Struct(f"<QQ{KEY_BYTES}sQ")
assert ENTRY.size == 32 and TRAILER.size == 64 and TOMBSTONE.size == 40

ENTRY_DTYPE = np.dtype([("key", f"V{KEY_BYTES}"), ("offset", "<u8"), ("length", "<u4"), ("rsv", "<u4")])
assert ENTRY_DTYPE.itemsize == ENTRY.size

_SEG_RE = re.compile(r"^seg-(\d{8,})\.dtkv$")
TOMBSTONE_FILE = "tombstones.log"
TORN, DAMAGED = "torn", "damaged"  # what ``parse_tombstones`` reports of an entry it skips
LOCK_FILE = "LOCK"


def segment_name(seq: int) -> str:
    return f"seg-{seq:08d}.dtkv"


def flushed_marker(path: Path) -> Path:
    """Marker file whose existence records that the segment is in the object tier."""
    return path.with_suffix(".flushed")


def list_segments(rank_dir: Path) -> list[tuple[int, Path]]:
    """(seq, path) of every segment file in ``rank_dir``, oldest first."""
    out = []
    for p in rank_dir.iterdir():
        m = _SEG_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    out.sort()
    return out


def footer_bytes(n_entries: int) -> int:
    """Size of a footer holding ``n_entries`` entries (a multiple of 4 KiB)."""
    return align_up(n_entries * ENTRY.size + TRAILER.size, ALIGN)


@dataclass(frozen=True)
class Footer:
    rank: int
    seq: int
    data_bytes: int
    sealed_at_ns: int
    entries: np.ndarray  # ENTRY_DTYPE, file order
    flags: int = 0  # trailer flags (``ONE_TENANT``)

    @property
    def footer_bytes(self) -> int:
        return footer_bytes(len(self.entries))


def build_footer(rank: int, seq: int, data_bytes: int, sealed_at_ns: int,
                 entries: Iterable[tuple[bytes, int, int]], out: np.ndarray | None = None,
                 flags: int = 0) -> np.ndarray:
    """Encode a footer (uint8 array of ``footer_bytes(n)``), into ``out`` when given; ``flags``
    are the trailer's (``ONE_TENANT``)."""
    table = np.array([(k, o, n, 0) for k, o, n in entries], dtype=ENTRY_DTYPE)
    fb = footer_bytes(len(table))
    buf = np.zeros(fb, np.uint8) if out is None else out[:fb]
    buf[:] = 0
    raw = table.tobytes()
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    head = TRAILER.pack(SEG_MAGIC, SEG_VERSION, flags, rank, seq, len(table), fb, data_bytes, sealed_at_ns,
                        xxhash.xxh3_64_intdigest(raw), 0)[:-8]
    trailer = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    buf[fb - TRAILER.size:] = np.frombuffer(trailer, np.uint8)
    return buf


def parse_trailer(last: bytes) -> tuple[int, int, int, int, int, int, int, int] | None:
    """Verify a trailer (the file's last 64 bytes).

    Returns (rank, seq, n_entries, footer_bytes, data_bytes, sealed_at_ns, entries_xxh3, flags)
    or None.
    """
    if len(last) != TRAILER.size:
        return None
    (magic, version, flags, rank, seq, n, fb, data_bytes, sealed_at, ent_sum, tsum) = TRAILER.unpack(last)
    if magic != SEG_MAGIC or version != SEG_VERSION:
        return None
    if xxhash.xxh3_64_intdigest(last[:-8]) != tsum or fb != footer_bytes(n):
        return None
    return rank, seq, n, fb, data_bytes, sealed_at, ent_sum, flags


def read_footer(fd: int, file_size: int) -> Footer | None:
    """The verified footer of a sealed segment, or None when it is absent or damaged.

    Checks the trailer checksum, the entries checksum, that data + footer is the whole file,
    and that every entry lies 4 KiB aligned inside the data region in increasing order.
    """
    import os

    if file_size < ALIGN or file_size % ALIGN:
        return None
    t = parse_trailer(os.pread(fd, TRAILER.size, file_size - TRAILER.size))
    if t is None:
        return None
    rank, seq, n, fb, data_bytes, sealed_at, ent_sum, flags = t
    if data_bytes + fb != file_size:
        return None
    raw = os.pread(fd, n * ENTRY.size, data_bytes)
    if len(raw) != n * ENTRY.size or xxhash.xxh3_64_intdigest(raw) != ent_sum:
        return None
    entries = np.frombuffer(raw, dtype=ENTRY_DTYPE).copy()
    offs, lens = entries["offset"].astype(np.int64), entries["length"].astype(np.int64)
    if n and (np.any(offs % ALIGN) or np.any(lens % ALIGN) or np.any(lens <= 0)
              or np.any(offs[1:] < offs[:-1] + lens[:-1]) or offs[-1] + lens[-1] > data_bytes):
        return None
    return Footer(rank, seq, data_bytes, sealed_at, entries, flags)


def read_footer_at(path: Path, file_size: int) -> Footer | None:
    """``read_footer`` through a fresh buffered descriptor (tier fds may be O_DIRECT)."""
    import os

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return read_footer(fd, file_size)
    finally:
        os.close(fd)


def pack_tombstone(seq: int, offset: int, key: bytes) -> bytes:
    head = TOMBSTONE.pack(seq, offset, key, 0)[:-8]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def parse_tombstones(raw: bytes, on_bad: Callable[[int, str], None] | None = None) -> list[tuple[int, int, bytes]]:
    """(seq, offset, key) of every intact tombstone, in log order.

    A damaged entry (bad checksum) and a torn last entry are skipped; ``on_bad`` gets each one's
    byte offset in the log and ``TORN`` or ``DAMAGED``.
    """
    out = []
    size = TOMBSTONE.size
    for at in range(0, len(raw) - size + 1, size):
        chunk = raw[at:at + size]
        seq, off, key, s = TOMBSTONE.unpack(chunk)
        if xxhash.xxh3_64_intdigest(chunk[:-8]) == s:
            out.append((seq, off, key))
        elif on_bad is not None:
            on_bad(at, DAMAGED)
    if len(raw) % size and on_bad is not None:
        on_bad(len(raw) - len(raw) % size, TORN)
    return out


def append_tombstones(fd: int, entries: bytes) -> None:
    """Append whole tombstones to the log open at ``fd`` (``O_APPEND``), never leaving part of one.

    The log is parsed in fixed-size steps from its start: a partial entry in the middle would shift
    every later one out of step, and each would then read as damaged and be dropped at the next
    start (its deleted record back in the index). So a log whose size is not a whole number of
    entries (a torn tail that start-up could not trim) is cut back first, and a short write is
    cut back before this raises. Raises ``OSError`` (nothing partial stays) when it cannot write.
    """
    size = os.fstat(fd).st_size
    if size % TOMBSTONE.size:
        os.ftruncate(fd, size - size % TOMBSTONE.size)
        size -= size % TOMBSTONE.size
    n = os.write(fd, entries)
    if n != len(entries):
        os.ftruncate(fd, size)
        raise OSError(errno.ENOSPC, f"short write to the tombstone log ({n} of {len(entries)} bytes)")


def read_tombstones(path: Path, on_bad: Callable[[int, str], None] | None = None) -> list[tuple[int, int, bytes]]:
    """``parse_tombstones`` of the log at ``path``; none when it does not exist.

    Raises ``OSError`` when it cannot be read, a non-regular file included (the tier quarantines
    such a log at start).
    """
    try:
        raw = read_regular(path)
    except FileNotFoundError:
        return []
    return parse_tombstones(raw, on_bad)
