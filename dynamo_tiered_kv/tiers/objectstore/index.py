"""Compact object index: 16-byte key -> (object id, offset, length) in about 25 bytes per block.

The SSD tier's ``CompactIndex`` (hash table over ``array`` columns, under 64 B/block) is sized for
one node's disk; the object tier indexes a whole namespace of a shared bucket (hundreds of
millions of blocks), so it keeps the same columns without any hash table:

* ``base``: numpy columns sorted by key (big-endian u64 halves ``k0``, ``k1``), plus ``obj``
  (u32 row of the ``ObjectTable``), ``off`` (u32 bytes) and ``len`` (``Lengths``: a u8 code per
  block into a table of the distinct record lengths, since a namespace has one or a few record
  sizes; u32 once there are more than 255): 25 B per block. Lookups binary-search ``k0``.
  Removed rows keep their key with ``obj = DEAD`` until the next compaction.
* ``delta``: a small dict of recent single inserts (this node's publishes), folded into ``base``
  when it grows past ``DELTA_MAX``; bulk loads (snapshots, manifest listings) merge directly.
* Keys are BLAKE2b digests, uniformly distributed, so ``k0`` ties are (nearly) nonexistent, but
  they are handled: rows sort by (k0, k1).

Offsets and lengths are u32: data objects up to 4 GiB are indexed (segments are 256 MiB);
entries beyond are refused by the caller.

Threads: one writer, any number of readers. Every change runs on the owner (the tier's event
loop, or the worker thread building a catalog nobody sees yet); ``get``/``in``/``len``/``keys``
may run on any thread (the engine's lookup, load and KV-event threads) without a lock. They read
one attribute, ``_pub``, holding the columns *and* the delta of one generation; merges and
compactions build new columns aside and swap ``_pub`` in one store. A published generation's
columns never change except for ``obj`` entries turning ``DEAD`` (a removal): single stores a
reader sees before or after, and a reader reads a row's ``obj`` once. Deltas change by single
dict operations (atomic under the GIL).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterator

import numpy as np

DEAD = np.uint32(0xFFFFFFFF)
DELTA_MAX = 65536
U32_MAX = 0xFFFFFFFF
CHUNK = 1 << 20  # rows per step of column-wide passes
MAX_CODES = 255  # distinct record lengths kept as u8 codes
Loc = tuple[int, int, int]  # (object id, offset, length)


class Lengths:
    """A u32 length per row, stored as u8 codes into ``table`` (sorted distinct lengths), or as
    the u32 lengths themselves (``table`` None) once there are more than ``MAX_CODES``.

    Immutable: every change returns a new ``Lengths`` (readers on other threads hold old ones)."""

    __slots__ = ("codes", "table")

    def __init__(self, codes: np.ndarray, table: np.ndarray | None) -> None:
        self.codes, self.table = codes, table

    @classmethod
    def of(cls, values: np.ndarray) -> Lengths:
        values = np.asarray(values, np.uint32)
        if not len(values):
            return cls(np.empty(0, np.uint8), np.empty(0, np.uint32))
        lo = values.min()
        if lo == values.max():  # the usual case: one record size in the namespace
            return cls(np.zeros(len(values), np.uint8), np.array([lo], np.uint32))
        table, codes = np.unique(values, return_inverse=True)
        if len(table) > MAX_CODES:
            return cls(values, None)
        return cls(codes.astype(np.uint8).reshape(-1), table.astype(np.uint32))

    def __len__(self) -> int:
        return len(self.codes)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + (0 if self.table is None else self.table.nbytes)

    def at(self, i: int) -> int:
        c = self.codes[i]
        return int(c if self.table is None else self.table[c])

    def decode(self, rows: slice | np.ndarray = slice(None)) -> np.ndarray:
        c = self.codes[rows]
        return c if self.table is None else self.table[c]

    def take(self, rows: np.ndarray) -> Lengths:
        return Lengths(self.codes[rows], self.table)

    def _coded(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(this column's codes, table, codes of ``values``) under a table that holds ``values``
        too: the table grows (existing codes remapped into new arrays) or the column widens.
        ``self`` is never changed: readers on other threads may hold it."""
        values = np.asarray(values, np.uint32)
        if self.table is None:
            return self.codes, None, values
        new = np.setdiff1d(values, self.table)
        if not len(new):
            return self.codes, self.table, np.searchsorted(self.table, values).astype(np.uint8)
        union = np.union1d(self.table, new).astype(np.uint32)
        if len(union) > MAX_CODES:
            return self.table[self.codes], None, values
        codes = np.searchsorted(union, self.table).astype(np.uint8)[self.codes]
        return codes, union, np.searchsorted(union, values).astype(np.uint8)

    def replaced(self, rows: np.ndarray, values: np.ndarray) -> Lengths:
        """A copy with ``rows`` set to ``values``."""
        codes, table, new = self._coded(np.atleast_1d(np.asarray(values, np.uint32)))
        codes = codes.copy() if codes is self.codes else codes
        codes[rows] = new
        return Lengths(codes, table)

    def insert(self, at: np.ndarray, values: np.ndarray) -> Lengths:
        codes, table, new = self._coded(values)
        return Lengths(np.insert(codes, at, new), table)

    def append(self, values: np.ndarray) -> Lengths:
        codes, table, new = self._coded(values)
        return Lengths(np.concatenate([codes, new]), table)


def split_keys(keys: bytes | bytearray | memoryview) -> tuple[np.ndarray, np.ndarray]:
    """(k0, k1) u64 columns of concatenated 16-byte keys (big-endian: sorts like the bytes)."""
    a = np.frombuffer(keys, dtype=">u8").reshape(-1, 2)
    return a[:, 0].astype(np.uint64), a[:, 1].astype(np.uint64)


def join_keys(k0: np.ndarray, k1: np.ndarray) -> bytes:
    out = np.empty((len(k0), 2), dtype=">u8")
    out[:, 0], out[:, 1] = k0, k1
    return out.tobytes()


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Building an index frees hundreds of MB of parsed manifests and sort temporaries in chunks
    under glibc's mmap threshold; without this they stay in the process RSS (over 100 B/block
    at 2 M blocks, against 25 B/block of columns).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _halves(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "big"), int.from_bytes(key[8:16], "big")


class _Generation:
    """The columns and the delta one reader sees together (see the module docstring)."""

    __slots__ = ("delta", "k0", "k1", "len", "obj", "off")

    def __init__(self, k0: np.ndarray, k1: np.ndarray, obj: np.ndarray, off: np.ndarray, ln: Lengths,
                 delta: dict[bytes, Loc]) -> None:
        self.k0, self.k1, self.obj, self.off, self.len, self.delta = k0, k1, obj, off, ln, delta

    def row(self, key: bytes) -> int:
        a, b = _halves(key)
        k0 = self.k0
        i = int(k0.searchsorted(a))
        n = len(k0)
        while i < n and k0[i] == a:
            if self.k1[i] == b:
                return i
            i += 1
        return -1

    def get(self, key: bytes) -> Loc | None:
        loc = self.delta.get(key)
        if loc is not None:
            return loc
        i = self.row(key)
        if i < 0:
            return None
        obj = self.obj[i]  # read once: a removal may turn it DEAD meanwhile
        return None if obj == DEAD else (int(obj), int(self.off[i]), self.len.at(i))


class CompactObjectIndex:
    """Sorted numpy columns + a small insert dict; see the module docstring.

    Owner: one thread changes it (the tier's event loop; a catalog being built: its worker).
    ``get``, ``in``, ``len`` and ``keys`` are safe from any thread, without a lock.
    """

    def __init__(self) -> None:
        e = np.empty(0, np.uint64)
        self._pub = _Generation(e, e, np.empty(0, np.uint32), np.empty(0, np.uint32),
                                Lengths.of(np.empty(0, np.uint32)), {})
        self._live_base = 0

    # the current generation's parts (owner-side code and tests; readers go through ``get``)
    k0 = property(lambda self: self._pub.k0)
    k1 = property(lambda self: self._pub.k1)
    obj = property(lambda self: self._pub.obj)
    off = property(lambda self: self._pub.off)
    len = property(lambda self: self._pub.len)
    delta = property(lambda self: self._pub.delta)

    def __len__(self) -> int:
        return self._live_base + len(self._pub.delta)  # from another thread: a count of a moment ago

    def nbytes(self) -> int:
        """Bytes held by the columns and the delta (dict slots + tuples + key objects, estimated)."""
        g = self._pub
        cols = sum(a.nbytes for a in (g.k0, g.k1, g.obj, g.off, g.len))  # Lengths too
        return cols + len(g.delta) * 200

    # --- point operations -----------------------------------------------------------------------
    def get(self, key: bytes) -> Loc | None:
        return self._pub.get(key)

    def __contains__(self, key: bytes) -> bool:
        return self._pub.get(key) is not None

    def put(self, key: bytes, obj: int, off: int, length: int) -> Loc | None:
        """Insert or replace; returns the previous location. (Owner only.)"""
        g = self._pub
        old = g.delta.get(key)
        g.delta[key] = (obj, off, length)  # first: a concurrent reader finds the key throughout
        if old is None:
            old = self._kill_row(g, key)  # a base row of the key stays DEAD until compaction
        if len(g.delta) > DELTA_MAX:
            self.compact()
        return old

    def remove(self, key: bytes) -> Loc | None:
        g = self._pub
        loc = g.delta.pop(key, None)
        base = self._kill_row(g, key)
        return loc if loc is not None else base

    def _kill_row(self, g: _Generation, key: bytes) -> Loc | None:
        i = g.row(key)
        if i < 0 or g.obj[i] == DEAD:
            return None
        loc = int(g.obj[i]), int(g.off[i]), g.len.at(i)
        g.obj[i] = DEAD
        self._live_base -= 1
        return loc

    def remove_objects(self, objs: np.ndarray) -> None:
        """Drop every block of the given object ids."""
        if len(objs) == 0:
            return
        g = self._pub
        hit = np.isin(g.obj, objs)
        self._live_base -= int(np.count_nonzero(hit))
        g.obj[hit] = DEAD
        drop = set(int(o) for o in objs)
        for k in [k for k, v in g.delta.items() if v[0] in drop]:
            del g.delta[k]

    def keys_of(self, objs: np.ndarray) -> list[bytes]:
        """The live keys of the given object ids (before ``remove_objects`` drops them)."""
        if len(objs) == 0:
            return []
        g = self._pub
        hit = np.isin(g.obj, objs) & (g.obj != DEAD)
        raw = join_keys(g.k0[hit], g.k1[hit])
        drop = set(int(o) for o in objs)
        return [raw[i:i + 16] for i in range(0, len(raw), 16)] + [k for k, v in g.delta.copy().items()
                                                                   if v[0] in drop]

    def keys(self) -> Iterator[bytes]:
        g = self._pub
        obj = g.obj.copy()  # one moment's liveness, the same length as the keys
        live = obj != DEAD
        raw = join_keys(g.k0[live], g.k1[live])
        base = [raw[i:i + 16] for i in range(0, len(raw), 16)]
        return iter(base + list(g.delta.copy()))

    def columns(self) -> tuple[np.ndarray, ...]:
        """Live rows, key-sorted: (k0, k1, obj, off, len) (the delta folded in first)."""
        self.compact()
        g = self._pub
        return g.k0, g.k1, g.obj, g.off, g.len.decode()

    def live_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The live rows as (object id, offset, length) columns, ``CHUNK`` rows at a time (then
        the delta): column-wide passes without whole-column temporaries (intp ids, f64 weights
        cost ~1 s of page faults at 10M rows)."""
        g = self._pub
        for i in range(0, len(g.obj), CHUNK):
            obj = g.obj[i:i + CHUNK].copy()  # one moment's liveness (a removal may turn a row DEAD)
            live = obj != DEAD
            yield obj[live], g.off[i:i + CHUNK][live], g.len.decode(slice(i, i + CHUNK))[live]
        d = np.array(list(g.delta.copy().values()), np.int64).reshape(-1, 3)
        if len(d):
            yield d[:, 0].astype(np.uint32), d[:, 1].astype(np.uint32), d[:, 2].astype(np.uint32)

    # --- bulk operations ------------------------------------------------------------------------
    def compact(self) -> None:
        """Fold the delta into the sorted columns and drop dead rows (a new generation)."""
        g = self._pub
        if not g.delta and self._live_base == len(g.k0):
            return
        keys = b"".join(g.delta)
        locs = np.array(list(g.delta.values()), dtype=np.int64).reshape(-1, 3)
        d0, d1 = split_keys(keys)
        live = g.obj != DEAD
        self._publish(np.concatenate([g.k0[live], d0]), np.concatenate([g.k1[live], d1]),
                      np.concatenate([g.obj[live], locs[:, 0].astype(np.uint32)]),
                      np.concatenate([g.off[live], locs[:, 1].astype(np.uint32)]),
                      g.len.take(live).append(locs[:, 2].astype(np.uint32)), presorted=not len(d0))

    def _publish(self, k0: np.ndarray, k1: np.ndarray, obj: np.ndarray, off: np.ndarray,
                 ln: np.ndarray | Lengths, presorted: bool = False) -> None:
        """Swap in new columns (fresh arrays nobody else holds) with an empty delta."""
        lengths = ln if isinstance(ln, Lengths) else Lengths.of(ln)
        if not presorted:
            order = np.lexsort((k1, k0))
            k0, k1, obj, off, lengths = k0[order], k1[order], obj[order], off[order], lengths.take(order)
        live = int(np.count_nonzero(obj != DEAD))
        self._pub = _Generation(k0, k1, obj, off, lengths, {})
        self._live_base = live

    def load_sorted(self, k0: np.ndarray, k1: np.ndarray, obj: np.ndarray, off: np.ndarray, ln: np.ndarray) -> None:
        """Replace everything with key-sorted, duplicate-free columns (a snapshot)."""
        self._publish(k0, k1, obj, off, ln, presorted=True)

    def merge(self, k0: np.ndarray, k1: np.ndarray, obj: np.ndarray, off: np.ndarray, ln: np.ndarray,
              created: np.ndarray) -> None:
        """Add rows; per key the object with the newest ``created[obj]`` wins (ties: the new row).

        ``created`` maps object id -> created_at for every object referenced here or indexed.
        """
        if len(k0) == 0:
            return
        self.compact()
        # newest per key among the new rows: sort by (key, created), keep each key's last row
        order = np.lexsort((created[obj], k1, k0))
        k0, k1, obj, off, ln = k0[order], k1[order], obj[order], off[order], ln[order]
        last = np.ones(len(k0), bool)
        last[:-1] = (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])
        k0, k1, obj, off, ln = k0[last], k1[last], obj[last], off[last], ln[last]
        g = self._pub
        n = len(g.k0)
        if n == 0:
            self._publish(k0, k1, obj, off, ln, presorted=True)
            return
        pos = np.searchsorted(g.k0, k0)
        while True:  # step past equal-k0 rows with a smaller k1 (lexicographic position)
            p = np.minimum(pos, n - 1)
            step = (pos < n) & (g.k0[p] == k0) & (g.k1[p] < k1)
            if not step.any():
                break
            pos = pos + step
        p = np.minimum(pos, n - 1)
        match = (pos < n) & (g.k0[p] == k0) & (g.k1[p] == k1)
        mi = pos[match]
        cur = g.obj[mi]
        wins = (cur == DEAD) | (created[np.where(cur == DEAD, 0, cur)] <= created[obj[match]])
        new = ~match
        ins = pos[new]
        # new arrays (np.insert copies): readers keep the published ones until the swap
        nobj = np.insert(g.obj, ins, obj[new])
        noff = np.insert(g.off, ins, off[new])
        nlen = g.len.insert(ins, ln[new])
        rows = mi[wins]
        rows = rows + np.searchsorted(ins, rows, side="right")  # where the kept rows moved to
        nobj[rows], noff[rows] = obj[match][wins], off[match][wins]
        if len(rows):
            nlen = nlen.replaced(rows, ln[match][wins])
        self._publish(np.insert(g.k0, ins, k0[new]), np.insert(g.k1, ins, k1[new]), nobj, noff, nlen,
                      presorted=True)


class ObjectTable:
    """Per data object (one manifest each): numpy columns, grown by 1/4 at a time.

    ``mdig``/``ddig``: manifest and data digests; ``ms``: the created-at ms of a new-style
    manifest name (-1: legacy name); ``created``: created_at; ``live``: live record bytes;
    ``flags``: ``ROOT`` (legacy root layout), ``GONE`` (forgotten); ``ten``: the tenant code of
    its records (``tenancy.TenantBook``; ``MIXED``: several). Names that are not canonical
    (written by other tools) are kept in ``odd``.

    Owner: the catalog's owner (see ``catalog.py``); read and changed there only.
    """

    ROOT = 1
    GONE = 2
    # digests as u1[16], not "S16": numpy strips trailing NUL bytes from S fields
    DTYPE = np.dtype([("mdig", "u1", (16,)), ("ddig", "u1", (16,)), ("ms", "<i8"), ("created", "<f8"),
                      ("live", "<i8"), ("flags", "u1"), ("ten", "<u4")])

    def __init__(self, rows: np.ndarray | None = None) -> None:
        self.rows = np.zeros(16, self.DTYPE) if rows is None else rows
        self.n = 0 if rows is None else len(rows)
        self.odd: dict[int, tuple[str, str]] = {}  # id -> (manifest name, data name)

    def nbytes(self) -> int:
        return self.rows.nbytes + 150 * len(self.odd)

    def add(self, mdig: bytes, ddig: bytes, ms: int, created: float, flags: int) -> int:
        if self.n == len(self.rows):
            grown = np.zeros(max(16, self.n + self.n // 4), self.DTYPE)
            grown[:self.n] = self.rows[:self.n]
            self.rows = grown
        i = self.n
        r = self.rows[i]
        r["mdig"] = np.frombuffer(mdig.ljust(16, b"\0"), np.uint8)
        r["ddig"] = np.frombuffer(ddig.ljust(16, b"\0"), np.uint8)
        r["ms"], r["created"], r["live"], r["flags"], r["ten"] = ms, created, 0, flags, 0
        self.n += 1
        return i

    @property
    def view(self) -> np.ndarray:
        return self.rows[:self.n]

    def created(self) -> np.ndarray:
        return self.rows["created"][:self.n]
