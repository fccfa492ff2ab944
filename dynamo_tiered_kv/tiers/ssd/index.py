"""Compact in-memory index: block key -> (segment seq, offset, length).

A Python ``dict[bytes, tuple]`` costs about 200 bytes per entry; this open-addressing hash table
over flat ``array.array`` columns costs 28 bytes per row (two u64 key halves, three u32) plus
8-16 bytes of int32 table slots per entry at a load factor of 0.25-0.5: under 64 bytes per block.
Keys are BLAKE2b digests, so their first 8 bytes are already uniformly distributed and serve as
the hash. Offsets and lengths are stored in 4 KiB pages (records are 4 KiB multiples). A count of
live keys per segment (one dict entry per segment, not per block) tells when a segment holds no
live record any more.

Not thread-safe: the tier guards it with its lock.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator

from ...blocks.codec import ALIGN
from ...blocks.keys import KEY_BYTES

_KEY = struct.Struct("<QQ")
_EMPTY = -1
_DELETED = -2
_DEAD_ROW = 0xFFFFFFFF  # seg value of a free row
_MIN_SLOTS = 1024


class CompactIndex:
    """Open-addressing (linear probing) hash table; rows are reused through a free list."""

    def __init__(self) -> None:
        self._k0 = array("Q")
        self._k1 = array("Q")
        self._seg = array("I")
        self._off = array("I")
        self._len = array("I")
        self._free = array("I")
        self._table = array("i", [_EMPTY]) * _MIN_SLOTS
        self._mask = _MIN_SLOTS - 1
        self._count = 0
        self._occupied = 0  # live + deleted slots
        self._per_seq: dict[int, int] = {}  # segment seq -> live keys in it

    def __len__(self) -> int:
        return self._count

    def nbytes(self) -> int:
        """Bytes held by the index's arrays (the memory cost that the 64 B/block target is about)."""
        cols = (self._k0, self._k1, self._seg, self._off, self._len, self._free, self._table)
        return sum(a.itemsize * a.buffer_info()[1] for a in cols)

    def live_in(self, seq: int) -> int:
        """How many keys currently live in segment ``seq``."""
        return self._per_seq.get(seq, 0)

    def _counted(self, seq: int, delta: int) -> None:
        n = self._per_seq.get(seq, 0) + delta
        if n:
            self._per_seq[seq] = n
        else:
            del self._per_seq[seq]

    def _find(self, k0: int, k1: int) -> tuple[int, int]:
        """(slot, row) of the key, or (insert slot, -1) when absent."""
        table, mask = self._table, self._mask
        i = k0 & mask
        first_free = -1
        while True:
            r = table[i]
            if r == _EMPTY:
                return (i if first_free < 0 else first_free), -1
            if r == _DELETED:
                if first_free < 0:
                    first_free = i
            elif self._k0[r] == k0 and self._k1[r] == k1:
                return i, r
            i = (i + 1) & mask

    def get(self, key: bytes) -> tuple[int, int, int] | None:
        """(seq, byte offset, byte length) of ``key``, or None."""
        k0, k1 = _KEY.unpack(key)
        _, r = self._find(k0, k1)
        if r < 0:
            return None
        return self._seg[r], self._off[r] * ALIGN, self._len[r] * ALIGN

    def __contains__(self, key: bytes) -> bool:
        k0, k1 = _KEY.unpack(key)
        return self._find(k0, k1)[1] >= 0

    def put(self, key: bytes, seq: int, offset: int, length: int) -> tuple[int, int, int] | None:
        """Insert or replace; returns the previous location, if any."""
        if len(key) != KEY_BYTES or offset % ALIGN or length % ALIGN:
            raise ValueError("index entries need 16-byte keys and 4 KiB aligned offset/length")
        k0, k1 = _KEY.unpack(key)
        slot, r = self._find(k0, k1)
        if r >= 0:
            old = (self._seg[r], self._off[r] * ALIGN, self._len[r] * ALIGN)
            self._seg[r], self._off[r], self._len[r] = seq, offset // ALIGN, length // ALIGN
            self._counted(old[0], -1)
            self._counted(seq, 1)
            return old
        if self._free:
            r = self._free.pop()
            self._k0[r], self._k1[r] = k0, k1
            self._seg[r], self._off[r], self._len[r] = seq, offset // ALIGN, length // ALIGN
        else:
            r = len(self._k0)
            self._k0.append(k0)
            self._k1.append(k1)
            self._seg.append(seq)
            self._off.append(offset // ALIGN)
            self._len.append(length // ALIGN)
        if self._table[slot] == _EMPTY:
            self._occupied += 1
        self._table[slot] = r
        self._count += 1
        self._counted(seq, 1)
        if self._occupied * 2 > len(self._table):
            self._rehash()
        return None

    def pop(self, key: bytes, only_seq: int | None = None) -> tuple[int, int, int] | None:
        """Remove ``key`` (only if it lives in segment ``only_seq``, when given); return its location."""
        k0, k1 = _KEY.unpack(key)
        slot, r = self._find(k0, k1)
        if r < 0 or (only_seq is not None and self._seg[r] != only_seq):
            return None
        loc = (self._seg[r], self._off[r] * ALIGN, self._len[r] * ALIGN)
        self._table[slot] = _DELETED
        self._seg[r] = _DEAD_ROW
        self._free.append(r)
        self._count -= 1
        self._counted(loc[0], -1)
        return loc

    def keys(self) -> Iterator[bytes]:
        """Snapshot of every live key."""
        seg, k0, k1 = self._seg, self._k0, self._k1
        return iter([_KEY.pack(k0[r], k1[r]) for r in range(len(seg)) if seg[r] != _DEAD_ROW])

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    def _rehash(self) -> None:
        size = _MIN_SLOTS
        while size < self._count * 4:
            size *= 2
        table = array("i", [_EMPTY]) * size
        mask = size - 1
        k0s, seg = self._k0, self._seg
        for r in range(len(seg)):
            if seg[r] == _DEAD_ROW:
                continue
            i = k0s[r] & mask
            while table[i] != _EMPTY:
                i = (i + 1) & mask
            table[i] = r
        self._table, self._mask, self._occupied = table, mask, self._count
