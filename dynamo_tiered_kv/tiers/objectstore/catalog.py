"""The object tier's view of one namespace: an ``ObjectTable`` plus a ``CompactObjectIndex``.

Filled from a snapshot (``snapshot.py``), from manifests (parsed straight into numpy columns,
no per-entry Python objects), and from this node's own publishes. Also keeps this node's
exclusions (records it stopped serving; local only, never written back to the bucket), and
what each tenant holds (``tenancy.TenantBook``: live bytes and blocks per tenant, exact).
Threads: a catalog being built belongs to one worker thread until the tier swaps it in; after
that every change runs on the tier's event loop. ``len(catalog)``, ``used`` and lookups through
``index`` (``CompactObjectIndex.get``) are safe from any thread; names (``data_name``) are
resolved on the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...blocks.keys import KEY_BYTES
from .index import DEAD, U32_MAX, CompactObjectIndex, ObjectTable, split_keys
from .layout import manifest_name_ms, parse_data_name, parse_manifest_name
from .manifest import MAX_RETAIN_S, ManifestError, checked_body, parse_retain
from .snapshot import OBJ_DTYPE, Snapshot, SnapshotError, mixed_rows
from .tenancy import MIXED, TenantBook

log = logging.getLogger(__name__)


@dataclass
class Parsed:
    """A manifest as columns (``Manifest`` without per-entry objects)."""

    data: str
    data_size: int
    created_at: float
    keys: bytes  # n x 16
    off: np.ndarray  # int64
    len: np.ndarray  # int64
    retain: tuple[tuple[bytes, int, float | None], ...] = ()  # (key, priority, expiry): optional field
    tenants: np.ndarray | None = None  # big-endian u64 tenant id per entry; None: all the default tenant's

    def retained_until(self) -> float | None:
        """How long retained entries extend this manifest's life past its TTL (None: none retained)."""
        if not self.retain:
            return None
        cap = self.created_at + MAX_RETAIN_S
        return max(cap if x is None else min(cap, x) for _, _, x in self.retain)


def parse_manifest(raw: bytes) -> Parsed:
    """Parse and check a manifest exactly as ``Manifest.from_bytes`` does, into columns."""
    try:
        body = checked_body(raw)
        ents = body["entries"]
        keys = bytes.fromhex("".join(e[0] for e in ents))
        off = np.array([e[1] for e in ents], dtype=np.int64).reshape(-1)
        ln = np.array([e[2] for e in ents], dtype=np.int64).reshape(-1)
        size = int(body["data_size"])
        if (len(keys) != KEY_BYTES * len(ents) or any(len(e[0]) != 2 * KEY_BYTES for e in ents)
                or (len(ents) and (off.min() < 0 or ln.min() <= 0 or int((off + ln).max()) > size))):
            raise ManifestError(f"an entry does not fit a {size}-byte object")
        retain = tuple((keys[i * KEY_BYTES:(i + 1) * KEY_BYTES], p, x)
                       for i, p, x in parse_retain(body.get("retain")) if 0 <= i < len(ents) and 0 < p <= 100)
        return Parsed(str(body["data"]), size, float(body["created_at"]), keys, off, ln, retain,
                      _tenant_column(body.get("tenants"), len(ents)))
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as e:
        raise ManifestError(f"unreadable manifest: {type(e).__name__}: {e}") from None


def _tenant_column(raw: object, n: int) -> np.ndarray | None:
    """The optional ``tenants`` field (one 16-hex-digit id per entry) as u64 values, checked as
    ``manifest.parse_tenants`` checks it."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != n or any(not isinstance(t, str) or len(t) != 16 for t in raw):
        raise ManifestError("tenants must list one 8-byte tenant id per entry")
    return np.frombuffer(bytes.fromhex("".join(raw)), ">u8").astype(np.uint64)


class Catalog:
    """Objects and blocks of one namespace (see module docstring)."""

    def __init__(self, *, namespaced: bool) -> None:
        self.namespaced = namespaced
        self.objs = ObjectTable()
        self.index = CompactObjectIndex()
        self.used = 0
        self.watermark_ms = -1  # newest new-style manifest name seen
        self.refused = 0  # entries not indexed (offset/length beyond 4 GiB)
        self.excl_loc: dict[bytes, set[tuple[str, int]]] = {}
        self.excl_key: set[bytes] = set()
        # columns of ``add_parsed(defer=True)`` batches, merged once by ``finish()``: one sort of
        # everything instead of an O(n) insert per batch (time, and heap fragments that RSS keeps)
        self._pending: list[tuple[np.ndarray, ...]] = []
        # retention classes read from manifests (optional field), for the tier to take over
        self.retained: dict[bytes, tuple[int, float | None]] = {}
        self.tenants = TenantBook()

    def __len__(self) -> int:
        return len(self.index)

    def nbytes(self) -> int:
        mixed = sum(o.nbytes + c.nbytes + 200 for o, c in self.tenants.mixed.values())
        return self.index.nbytes() + self.objs.nbytes() + mixed

    def tenant_usage(self) -> dict[bytes, tuple[int, int]]:
        """tenant -> (live record bytes, blocks); safe from any thread (``TenantBook.usage``)."""
        return self.tenants.usage()

    def _set_tenants(self, i: int, offsets: np.ndarray, codes: np.ndarray | None) -> None:
        self.objs.rows["ten"][i] = self.tenants.set_object(i, offsets, codes)

    def _record_code(self, i: int, offset: int) -> int:
        return self.tenants.record_code(int(self.objs.rows["ten"][i]), i, offset)

    # --- names ----------------------------------------------------------------------------------
    def data_name(self, i: int) -> str:
        if i in self.objs.odd:
            return self.objs.odd[i][1]
        r = self.objs.rows[i]
        root = "/" if self.namespaced and r["flags"] & ObjectTable.ROOT else ""
        return f"{root}data/{r['ddig'].tobytes().hex()}.seg"

    def manifest_name(self, i: int) -> str:
        if i in self.objs.odd:
            return self.objs.odd[i][0]
        r = self.objs.rows[i]
        root = "/" if self.namespaced and r["flags"] & ObjectTable.ROOT else ""
        md = r["mdig"].tobytes().hex()
        return f"{root}manifests/{md}.json" if r["ms"] < 0 else root + manifest_name_ms(int(r["ms"]), md)

    def names(self, since_ms: int | None = None, *, root: bool = False) -> dict[str, int]:
        """Manifest name -> object id (of the namespace's own prefix, or of the legacy root)."""
        v = self.objs.view
        sel = (v["flags"] & ObjectTable.ROOT) == (ObjectTable.ROOT if root else 0)
        if since_ms is not None:
            sel &= v["ms"] >= since_ms
        return {self.manifest_name(int(i)).lstrip("/"): int(i) for i in np.flatnonzero(sel)}

    # --- adding ---------------------------------------------------------------------------------
    def _register(self, name: str, data: str, ms_created: float, *, root: bool, gone: bool) -> int:
        pm = parse_manifest_name(name)
        dd = parse_data_name(data)
        flags = (ObjectTable.ROOT if root else 0) | (ObjectTable.GONE if gone else 0)
        ms = pm[0] if pm else -1
        i = self.objs.add(pm[1] if pm else b"", dd or b"", ms, ms_created, flags)
        if pm is None or dd is None:
            self.objs.odd[i] = (name, ("/" + data if root and self.namespaced else data))
        self.watermark_ms = max(self.watermark_ms, ms)
        return i

    def add_parsed(self, batch: Sequence[tuple[str, Parsed | None]], *, cutoff: float | None,
                   root: bool = False, defer: bool = False) -> None:
        """Index manifests; ``None`` (unreadable) and expired ones are remembered, not indexed.

        ``defer``: only collect the blocks; they are indexed by ``finish()`` (a catalog still being
        built, which nobody reads meanwhile).
        """
        cols: list[tuple[np.ndarray, ...]] = []
        now = time.time()
        for name, p in batch:
            if p is None:
                continue
            kept = p.retained_until()  # retained entries extend the TTL (up to MAX_RETAIN_S)
            expired = cutoff is not None and p.created_at < cutoff and (kept is None or kept <= now)
            if not expired:
                for key, prio, x in p.retain:
                    self.retained[key] = (prio, x)
            i = self._register(name, p.data, p.created_at, root=root, gone=expired)
            if expired or not len(p.off):
                continue
            ok = (p.off + p.len <= U32_MAX) & (p.len <= U32_MAX)
            self.refused += int(len(ok) - np.count_nonzero(ok))
            self._set_tenants(i, p.off[ok], None if p.tenants is None else self.tenants.codes_of(p.tenants[ok]))
            k0, k1 = split_keys(p.keys)
            cols.append((k0[ok], k1[ok], np.full(int(ok.sum()), i, np.uint32), p.off[ok], p.len[ok]))
        if not cols:
            return
        k0, k1, obj, off, ln = (np.concatenate([c[j] for c in cols]) for j in range(5))
        self._pending.append((k0, k1, obj, off.astype(np.uint32), ln.astype(np.uint32)))
        if not defer:
            self.finish()

    def finish(self) -> None:
        """Index the blocks collected by deferred ``add_parsed`` calls (in their order: on equal
        ``created_at`` the later batch wins, as with one call per batch)."""
        if not self._pending:
            return
        if len(self._pending) == 1:
            k0, k1, obj, off, ln = self._pending[0]
        else:
            k0, k1, obj, off, ln = (np.concatenate([c[j] for c in self._pending]) for j in range(5))
        self._pending = []
        if self.excl_loc or self.excl_key:
            keep = self._not_excluded(k0, k1, obj, off)
            k0, k1, obj, off, ln = k0[keep], k1[keep], obj[keep], off[keep], ln[keep]
        self.index.merge(k0, k1, obj, off, ln, self.objs.created())
        self.recount()

    def _not_excluded(self, k0: np.ndarray, k1: np.ndarray, obj: np.ndarray, off: np.ndarray) -> np.ndarray:
        ex = list(self.excl_key | set(self.excl_loc))
        e0, _ = split_keys(b"".join(ex))
        keep = np.ones(len(k0), bool)
        for r in np.flatnonzero(np.isin(k0, e0)):  # few rows: exact check in Python
            key = int(k0[r]).to_bytes(8, "big") + int(k1[r]).to_bytes(8, "big")
            if key in self.excl_key or (self.data_name(int(obj[r])), int(off[r])) in self.excl_loc.get(key, ()):
                keep[r] = False
        return keep

    def add_fresh(self, name: str, data: str, created_at: float,
                  entries: Iterable[tuple[bytes, int, int, bytes]]) -> None:
        """Index what this node just published, ``(key, offset, length, tenant)`` per record
        (newest wins; lifts this node's exclusions)."""
        self.finish()
        ents = list(entries)
        i = self.names(int(created_at * 1000) - 1).get(name)  # a re-publish of the same manifest
        if i is None:
            i = self._register(name, data, created_at, root=False, gone=False)
        if self.objs.rows["live"][i] == 0:  # new or forgotten: its records' tenants are (re)set
            self._set_tenants(i, np.array([e[1] for e in ents], np.int64),
                              np.array([self.tenants.code_of(e[3]) for e in ents], np.uint32))
        self.objs.rows["flags"][i] &= ~np.uint8(ObjectTable.GONE)
        for key, off, n, _ in ents:  # this node's own write wins in its index
            self.excl_loc.pop(key, None)
            self.excl_key.discard(key)
            if off + n > U32_MAX:
                self.refused += 1
                continue
            old = self.index.put(key, i, off, n)
            self._account(i, off, n, old)

    def _account(self, i: int, off: int, n: int, old: tuple[int, int, int] | None) -> None:
        if old is not None:
            self._uncount(old)
        self.objs.rows["live"][i] += n
        self.used += n
        self.tenants.count(self._record_code(i, off), n, 1)

    def _uncount(self, old: tuple[int, int, int]) -> None:
        """The live record at ``old`` (object, offset, length) left the index."""
        self.objs.rows["live"][old[0]] -= old[2]
        self.used -= old[2]
        self.tenants.count(self._record_code(old[0], old[1]), -old[2], -1)

    def recount(self) -> None:
        """Live bytes per object, ``used`` and the per-tenant totals, from the index (one pass)."""
        n = self.objs.n
        acc = np.zeros(n, np.float64)
        count = np.zeros(n, np.int64)
        codes = self.objs.rows["ten"][:n]
        # an object gone from the view keeps its code, but its records' tenants left with it
        # (``forget``): only objects still in the view are looked up record by record
        is_mixed = (codes == MIXED) & ((self.objs.rows["flags"][:n] & ObjectTable.GONE) == 0)
        mixed = self.tenants.mixed_table() if bool(is_mixed.any()) else None
        totals = self.tenants.fresh_totals()
        for obj, off, ln in self.index.live_chunks():
            acc += np.bincount(obj, weights=ln, minlength=n)[:n]
            count += np.bincount(obj, minlength=n)[:n]
            if mixed is not None:
                m = is_mixed[obj]
                if bool(m.any()):
                    self.tenants.count_rows(mixed, obj[m], off[m], ln[m], totals)
        live = acc.astype(np.int64)
        self.objs.rows["live"][:n] = live
        self.used = int(live.sum())
        self.tenants.finish_recount(codes, live, count, totals)

    # --- removing -------------------------------------------------------------------------------
    def remove(self, key: bytes) -> tuple[int, int, int] | None:
        old = self.index.remove(key)
        if old is not None:
            self._uncount(old)
        return old

    def forget(self, ids: Sequence[int] | np.ndarray) -> None:
        """Drop objects (gone from the bucket, expired, evicted) and all their blocks."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        self.finish()
        self.objs.rows["flags"][ids] |= ObjectTable.GONE
        self.index.remove_objects(ids.astype(np.uint32))
        self.tenants.forget_objects(ids)
        self.recount()

    def exclude(self, key: bytes, data: str, offset: int) -> None:
        """Stop serving ``key`` at this location (local only)."""
        self.excl_loc.setdefault(key, set()).add((data, offset))
        cur = self.index.get(key)
        if cur is not None and cur[1] == offset and self.data_name(cur[0]) == data:
            self.remove(key)

    def exclude_key(self, key: bytes) -> None:
        """Stop serving every copy of ``key`` (``ObjectTier.delete``)."""
        self.excl_key.add(key)
        self.remove(key)

    def take_retained(self) -> dict[bytes, tuple[int, float | None]]:
        out, self.retained = self.retained, {}
        return out

    def object_ranks(self, ranks: Iterable[tuple[bytes, int]]) -> dict[int, int]:
        """Object id -> highest retention rank of its live blocks, from ``(key, rank)`` pairs."""
        out: dict[int, int] = {}
        for key, r in ranks:
            loc = self.index.get(key)
            if loc is not None:
                out[loc[0]] = max(out.get(loc[0], -1), r)
        return out

    # --- snapshots ------------------------------------------------------------------------------
    def to_snapshot(self, retained: Mapping[bytes, tuple[int, float | None]] | None = None) -> Snapshot:
        """The compacted index; ``retained``: retention classes to carry, of indexed keys only."""
        self.finish()
        k0, k1, obj, off, ln = self.index.columns()
        v = self.objs.view
        keep = (v["flags"] & ObjectTable.GONE) == 0
        remap = np.cumsum(keep) - 1
        objects = np.zeros(int(keep.sum()), OBJ_DTYPE)
        for f in ("mdig", "ddig", "ms", "created"):
            objects[f] = v[f][keep]
        objects["flags"] = v["flags"][keep] & ObjectTable.ROOT
        odd = {int(remap[i]): names for i, names in self.objs.odd.items() if keep[i]}
        live = obj != DEAD
        kept = {k: r for k, r in (retained or {}).items() if self.index.get(k) is not None}
        mixed = [(int(remap[i]), offs, codes) for i, (offs, codes) in sorted(self.tenants.mixed.items()) if keep[i]]
        return Snapshot(objects, odd, k0[live], k1[live], remap[obj[live]].astype(np.uint32), off[live], ln[live],
                        self.watermark_ms, retained=kept, tenants=list(self.tenants.ids),
                        object_tenants=v["ten"][keep].copy(), mixed=mixed_rows(mixed))

    def load_snapshot(self, s: Snapshot, cutoff: float | None) -> None:
        """Start from ``s``. Raises ``SnapshotError`` for one that predates tenants (version 1
        or 2): it cannot tell whose records it lists (docs/OBJECTS.md, "Tenants")."""
        if s.tenants is None or s.object_tenants is None:
            raise SnapshotError("the snapshot does not name its records' tenants (written before version 3)")
        rows = np.zeros(len(s.objects), ObjectTable.DTYPE)
        for f in ("mdig", "ddig", "ms", "created", "flags"):
            rows[f] = s.objects[f]
        rows["ten"] = s.object_tenants
        self.tenants = TenantBook(s.tenants)
        if s.mixed is not None and len(s.mixed):
            bounds = np.flatnonzero(np.diff(s.mixed["obj"])) + 1
            for part in np.split(s.mixed, bounds):
                self.tenants.mixed[int(part["obj"][0])] = (part["off"].astype(np.uint32),
                                                           part["code"].astype(np.uint32))
        self.objs = ObjectTable(rows)
        self.objs.odd = dict(s.odd)
        self.index.load_sorted(s.k0, s.k1, s.obj, s.off, s.len)
        self.retained.update(s.retained)  # manifests ingested after it override (newest wins)
        self.watermark_ms = max(s.watermark_ms, int(rows["ms"].max()) if len(rows) else -1)
        if cutoff is not None:
            self.forget(np.flatnonzero(rows["created"] < cutoff))
        self.recount()
