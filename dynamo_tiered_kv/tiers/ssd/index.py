"""Compact in-memory index: block key -> (segment seq, offset, length, tenant).

A Python ``dict[bytes, tuple]`` costs about 200 bytes per entry; this open-addressing hash table
over flat ``array.array`` columns costs 30 bytes per row (two u64 key halves, three u32, a u16
tenant code) plus 8-16 bytes of int32 table slots per entry at a load factor of 0.25-0.5: under
64 bytes per block. A tenant id (8 bytes) is stored once in a code table; a code whose last row
goes is reused, so at most 65,536 tenants can hold blocks in one tier at a time.
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
from ...blocks.tenant import DEFAULT_TENANT

_KEY = struct.Struct("<QQ")
_EMPTY = -1
_DELETED = -2
_DEAD_ROW = 0xFFFFFFFF  # seg value of a free row
_MIN_SLOTS = 1024
_MAX_TENANTS = 1 << 16  # codes fit the u16 column

Entry = tuple[int, int, int, bytes]  # (seq, byte offset, byte length, tenant)


class CompactIndex:
    """Open-addressing (linear probing) hash table; rows are reused through a free list."""

    def __init__(self) -> None:
        self._k0 = array("Q")
        self._k1 = array("Q")
        self._seg = array("I")
        self._off = array("I")
        self._len = array("I")
        self._ten = array("H")  # tenant code of each row (``_tenants``)
        self._free = array("I")
        self._table = array("i", [_EMPTY]) * _MIN_SLOTS
        self._mask = _MIN_SLOTS - 1
        self._count = 0
        self._occupied = 0  # live + deleted slots
        self._per_seq: dict[int, int] = {}  # segment seq -> live keys in it
        self._tenants: list[bytes] = [DEFAULT_TENANT]  # code -> tenant id (code 0: the default tenant)
        self._code: dict[bytes, int] = {DEFAULT_TENANT: 0}
        self._code_rows: list[int] = [0]  # code -> live rows naming it
        self._free_codes: list[int] = []

    def __len__(self) -> int:
        return self._count

    def nbytes(self) -> int:
        """Bytes held by the index's arrays (the memory cost that the 64 B/block target is about)."""
        cols = (self._k0, self._k1, self._seg, self._off, self._len, self._ten, self._free, self._table)
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

    def _code_of(self, tenant: bytes) -> int:
        """The code of ``tenant``, assigned on first use (``ValueError`` past 65,536 tenants)."""
        c = self._code.get(tenant)
        if c is not None:
            return c
        if self._free_codes:
            c = self._free_codes.pop()
            self._tenants[c] = tenant
            self._code_rows[c] = 0
        elif len(self._tenants) < _MAX_TENANTS:
            c = len(self._tenants)
            self._tenants.append(tenant)
            self._code_rows.append(0)
        else:
            raise ValueError(f"the SSD index holds blocks of {_MAX_TENANTS} tenants, its most")
        self._code[tenant] = c
        return c

    def _code_released(self, c: int) -> None:
        self._code_rows[c] -= 1
        if self._code_rows[c] == 0 and c != 0:
            del self._code[self._tenants[c]]
            self._free_codes.append(c)

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

    def entry(self, key: bytes) -> Entry | None:
        """(seq, byte offset, byte length, tenant) of ``key``, or None."""
        k0, k1 = _KEY.unpack(key)
        _, r = self._find(k0, k1)
        if r < 0:
            return None
        return self._seg[r], self._off[r] * ALIGN, self._len[r] * ALIGN, self._tenants[self._ten[r]]

    def __contains__(self, key: bytes) -> bool:
        k0, k1 = _KEY.unpack(key)
        return self._find(k0, k1)[1] >= 0

    def put(self, key: bytes, seq: int, offset: int, length: int,
            tenant: bytes = DEFAULT_TENANT) -> tuple[int, int, int] | None:
        """Insert or replace; returns the previous location, if any."""
        old = self.put_entry(key, seq, offset, length, tenant)
        return None if old is None else old[:3]

    def put_entry(self, key: bytes, seq: int, offset: int, length: int, tenant: bytes = DEFAULT_TENANT) -> Entry | None:
        """Insert or replace; returns the previous entry (with its tenant), if any."""
        if len(key) != KEY_BYTES or offset % ALIGN or length % ALIGN:
            raise ValueError("index entries need 16-byte keys and 4 KiB aligned offset/length")
        k0, k1 = _KEY.unpack(key)
        slot, r = self._find(k0, k1)
        code = self._code_of(tenant)
        self._code_rows[code] += 1
        if r >= 0:
            old_code = self._ten[r]
            old = (self._seg[r], self._off[r] * ALIGN, self._len[r] * ALIGN, self._tenants[old_code])
            self._seg[r], self._off[r], self._len[r], self._ten[r] = seq, offset // ALIGN, length // ALIGN, code
            self._code_released(old_code)
            self._counted(old[0], -1)
            self._counted(seq, 1)
            return old
        if self._free:
            r = self._free.pop()
            self._k0[r], self._k1[r] = k0, k1
            self._seg[r], self._off[r], self._len[r], self._ten[r] = seq, offset // ALIGN, length // ALIGN, code
        else:
            r = len(self._k0)
            self._k0.append(k0)
            self._k1.append(k1)
            self._seg.append(seq)
            self._off.append(offset // ALIGN)
            self._len.append(length // ALIGN)
            self._ten.append(code)
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
        e = self.pop_entry(key, only_seq)
        return None if e is None else e[:3]

    def pop_entry(self, key: bytes, only_seq: int | None = None) -> Entry | None:
        """``pop``, returning the removed entry with its tenant."""
        k0, k1 = _KEY.unpack(key)
        slot, r = self._find(k0, k1)
        if r < 0 or (only_seq is not None and self._seg[r] != only_seq):
            return None
        code = self._ten[r]
        loc = (self._seg[r], self._off[r] * ALIGN, self._len[r] * ALIGN, self._tenants[code])
        self._table[slot] = _DELETED
        self._seg[r] = _DEAD_ROW
        self._free.append(r)
        self._count -= 1
        self._counted(loc[0], -1)
        self._code_released(code)
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
