"""Tenants in the object tier: what each tenant holds in a namespace, and the quota's victims.

Every manifest names each record's tenant (optional ``tenants`` field; absent: the default
tenant). The catalog keeps, per object, one tenant *code* (u32 in the ``ObjectTable`` row) into a
small table of tenant ids (``TenantBook.ids``); an object whose records belong to several tenants
(possible without quotas: SSD segments then mix tenants) has the code ``MIXED`` and its records'
codes in ``TenantBook.mixed``: per object, its records' offsets (u32, sorted) and codes (u16 while
the table holds at most 65,536 tenants). Memory: nothing per record in a single-tenant object
(every object written with quotas on), 6 bytes per record in a mixed one, 4 bytes per object.

``TenantBook.bytes``/``blocks`` hold each code's live record bytes and blocks, exact: recounted
from the index with the objects' live bytes (``Catalog.recount``) and kept by single changes in
between (``Catalog.add_fresh``, ``remove``).

``capacity_victims`` is the object tier's eviction rule with quotas (docs/OBJECTS.md, "Tenants"):
a tenant over its limit loses its own objects (oldest, lowest retention rank first); when the
namespace is over capacity after that, objects of tenants still over their limit go first, then
the plain order.

Threads: owned like the catalog that holds it (module docstring of ``catalog.py``): changed on
one thread; ``usage`` may be read from any thread (a copy of one moment, or of a moment ago).
"""

from __future__ import annotations

import numpy as np

from ...blocks.tenant import DEFAULT_TENANT
from ...policy.quotas import TenantQuotas
from .index import ObjectTable

MIXED = 0xFFFFFFFF  # object code: its records belong to several tenants (``TenantBook.mixed``)
_U16_CODES = 1 << 16


class TenantBook:
    """Tenant codes, mixed objects' record codes and per-tenant live totals (module docstring)."""

    def __init__(self, ids: list[bytes] | None = None) -> None:
        self.ids: list[bytes] = list(ids) if ids else [DEFAULT_TENANT]  # code -> tenant id
        self._code: dict[bytes, int] = {t: c for c, t in enumerate(self.ids)}
        self.mixed: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # object -> (offsets, codes)
        self.bytes = np.zeros(len(self.ids), np.int64)  # live record bytes per code
        self.blocks = np.zeros(len(self.ids), np.int64)

    def code_of(self, tenant: bytes) -> int:
        c = self._code.get(tenant)
        if c is None:
            c = self._code[tenant] = len(self.ids)
            self.ids.append(tenant)
        return c

    def codes_of(self, tenants: np.ndarray) -> np.ndarray:
        """Codes of tenant ids given as big-endian u64 values (one per record)."""
        uniq, inv = np.unique(tenants, return_inverse=True)
        table = np.array([self.code_of(int(t).to_bytes(8, "big")) for t in uniq], np.uint32)
        return table[inv.reshape(-1)]

    def set_object(self, obj: int, offsets: np.ndarray, codes: np.ndarray | None) -> int:
        """Record the tenants of object ``obj``'s records (``codes`` None: all the default
        tenant's); returns the object's code (``MIXED`` when several)."""
        self.mixed.pop(obj, None)
        if codes is None or not len(codes):
            return 0
        first = int(codes[0])
        if bool(np.all(codes == first)):
            return first
        order = np.argsort(offsets, kind="stable")
        small = np.uint16 if len(self.ids) <= _U16_CODES else np.uint32
        self.mixed[obj] = (np.asarray(offsets, np.uint32)[order], np.asarray(codes)[order].astype(small))
        return MIXED

    def record_code(self, obj_code: int, obj: int, offset: int) -> int:
        """The code of the record at ``offset`` of object ``obj`` (whose code is ``obj_code``)."""
        if obj_code != MIXED:
            return obj_code
        offs, codes = self.mixed[obj]
        return int(codes[min(int(np.searchsorted(offs, offset)), len(offs) - 1)])

    def forget_objects(self, objs: np.ndarray) -> None:
        for o in objs.tolist():
            self.mixed.pop(int(o), None)

    def _grown(self) -> None:
        n = len(self.ids)
        if len(self.bytes) < n:
            self.bytes = np.concatenate([self.bytes, np.zeros(n - len(self.bytes), np.int64)])
            self.blocks = np.concatenate([self.blocks, np.zeros(n - len(self.blocks), np.int64)])

    def count(self, code: int, nbytes: int, blocks: int) -> None:
        """Add (or with negative numbers, take away) live records of ``code``."""
        self._grown()
        self.bytes[code] += nbytes
        self.blocks[code] += blocks

    def mixed_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys ``object << 32 | offset`` ascending, codes) of every mixed object's records, for
        ``count_rows`` (a recount's temporary: 16 B per record of the mixed objects)."""
        ids = sorted(self.mixed)
        keys = np.concatenate([(np.uint64(o) << np.uint64(32)) | self.mixed[o][0].astype(np.uint64) for o in ids])
        codes = np.concatenate([self.mixed[o][1].astype(np.int64) for o in ids])
        return keys, codes

    def count_rows(self, table: tuple[np.ndarray, np.ndarray], obj: np.ndarray, off: np.ndarray,
                   ln: np.ndarray, into: tuple[np.ndarray, np.ndarray]) -> None:
        """Add live rows (object, offset, length) of mixed objects, their codes from ``table``,
        to ``into`` (bytes, blocks per code: a recount's totals being built)."""
        keys, codes = table
        want = (obj.astype(np.uint64) << np.uint64(32)) | off.astype(np.uint64)
        c = codes[np.minimum(np.searchsorted(keys, want), len(keys) - 1)]
        n = len(self.ids)
        into[0][:] += np.bincount(c, weights=ln, minlength=n).round().astype(np.int64)
        into[1][:] += np.bincount(c, minlength=n)

    def finish_recount(self, obj_codes: np.ndarray, live: np.ndarray, count: np.ndarray,
                       into: tuple[np.ndarray, np.ndarray]) -> None:
        """Add the single-tenant objects' live bytes and blocks (``live``, ``count``: one entry
        per object) to ``into`` and publish it as the totals (one swap: readers on other threads
        see the old totals or the new ones)."""
        n = len(self.ids)
        single = obj_codes != MIXED
        c = obj_codes[single].astype(np.int64)
        nbytes = into[0] + np.bincount(c, weights=live[single], minlength=n).round().astype(np.int64)
        blocks = into[1] + np.bincount(c, weights=count[single], minlength=n).round().astype(np.int64)
        self.bytes, self.blocks = nbytes, blocks

    def fresh_totals(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(len(self.ids), np.int64), np.zeros(len(self.ids), np.int64)

    def usage(self) -> dict[bytes, tuple[int, int]]:
        """tenant -> (live bytes, blocks) of every tenant holding a block (a copy)."""
        nbytes, blocks, ids = self.bytes, self.blocks, self.ids  # one moment's arrays
        return {ids[c]: (int(nbytes[c]), int(blocks[c])) for c in np.flatnonzero(blocks > 0).tolist()}

    def over(self, quotas: TenantQuotas, freed: np.ndarray | None = None) -> list[tuple[int, int]]:
        """(code, bytes over its limit) of each tenant over its limit, most over first; ``freed``:
        bytes per code already chosen to go."""
        self._grown()
        held = self.bytes if freed is None else self.bytes - freed
        out = [(int(held[c]) - quotas.limit(self.ids[c]), c) for c in np.flatnonzero(held > 0).tolist()]
        return [(c, x) for x, c in sorted(out, reverse=True) if x > 0]


def capacity_victims(book: TenantBook, view: np.ndarray, used: int, capacity: int,
                     quotas: TenantQuotas | None, ranks: dict[int, int] | None) -> np.ndarray:
    """Objects to drop (ids): each tenant over its limit loses its own objects until within it;
    then, while the namespace is over ``capacity``, objects of tenants still over their limit
    first, then any (oldest first within retention ranks, as ``oldest_first``).

    ``view``: the ``ObjectTable`` rows (``live``, ``flags``, ``created``, ``ten``).
    """
    cand = ((view["flags"] & ObjectTable.GONE) == 0) & (view["live"] > 0)
    chosen: list[np.ndarray] = []
    freed = np.zeros(len(book.ids), np.int64)
    if quotas is not None:
        for code, excess in book.over(quotas):
            own = cand & (view["ten"] == code)
            got = _until(view, own, excess, ranks)
            chosen.append(got)
            cand[got] = False
            freed[code] += int(view["live"][got].sum())
    rest = used - int(freed.sum()) - capacity
    if rest > 0:
        first = None
        if quotas is not None:
            still = [c for c, _ in book.over(quotas, freed)]
            first = np.isin(view["ten"], np.array(still, np.uint32)) if still else None
        chosen.append(_until(view, cand, rest, ranks, first))
    return np.concatenate(chosen).astype(np.int64) if chosen else np.empty(0, np.int64)


def oldest_first(view: np.ndarray, among: np.ndarray, ranks: dict[int, int] | None,
                 first: np.ndarray | None = None) -> np.ndarray:
    """Ids of the objects in ``among`` (a mask) in eviction order: those in ``first`` (a mask)
    before the rest, then by retention rank (``Catalog.object_ranks``: expired -1, ordinary 0,
    protected by priority), then oldest first."""
    cand = np.flatnonzero(among)
    keys: list[np.ndarray] = [view["created"][cand]]
    if ranks:
        keys.append(np.array([ranks.get(int(i), 0) for i in cand], dtype=np.int64))
    if first is not None:
        keys.append(np.where(first[cand], 0, 1))
    return cand[np.lexsort(keys)] if len(keys) > 1 else cand[np.argsort(keys[0], kind="stable")]


def _until(view: np.ndarray, among: np.ndarray, nbytes: int, ranks: dict[int, int] | None,
           first: np.ndarray | None = None) -> np.ndarray:
    """The shortest eviction-order prefix of ``among`` holding ``nbytes`` live bytes (all of it
    when it holds less)."""
    order = oldest_first(view, among, ranks, first)
    freed = np.cumsum(view["live"][order])
    return order[:int(np.searchsorted(freed, nbytes)) + 1]
