"""Object index: background open, compact index, namespace isolation, snapshots, legacy layout."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np

from dynamo_tiered_kv.testing.records import TEST_NAMESPACE, make_record, random_key
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.gc import gc_bucket
from dynamo_tiered_kv.tiers.objectstore.index import MAX_CODES, CompactObjectIndex, Lengths, join_keys, split_keys
from dynamo_tiered_kv.tiers.objectstore.layout import SNAPSHOT_NAME, ns_prefix
from dynamo_tiered_kv.tiers.objectstore.snapshot import SnapshotError, decode

NS_A, NS_B = TEST_NAMESPACE, b"\x02" * 16


async def _tier(root: Path, ns: bytes | None, **kw: object) -> ObjectTier:
    t = ObjectTier(LocalDirBackend(root), namespace=ns, **kw)  # type: ignore[arg-type]
    await t.open()
    assert await t.wait_ready(30)
    return t


async def _write(t: ObjectTier, n: int, tag: bytes) -> list[tuple[bytes, bytes]]:
    recs = [(k, make_record(k, i)) for i, k in enumerate(random_key(i, tag) for i in range(n))]
    await t.write_many([(k, memoryview(v)) for k, v in recs])
    return recs


def test_compact_index_matches_a_dict() -> None:
    rng = np.random.default_rng(1)
    idx, model = CompactObjectIndex(), {}
    keys = [rng.bytes(16) for _ in range(3000)]
    k0, k1 = split_keys(b"".join(keys[:2000]))
    created = np.arange(10, dtype=np.float64)
    obj = rng.integers(0, 10, 2000).astype(np.uint32)
    idx.merge(k0, k1, obj, np.arange(2000, dtype=np.uint32), np.ones(2000, np.uint32), created)
    for i, k in enumerate(keys[:2000]):
        model[k] = (int(obj[i]), i, 1)
    for i, k in enumerate(keys[1000:]):  # overwrite half, add new
        idx.put(k, 9, i, 2)
        model[k] = (9, i, 2)
    for k in keys[::7]:
        assert idx.remove(k) == model.pop(k)
    idx.compact()
    assert len(idx) == len(model) and all(idx.get(k) == v for k, v in model.items())
    assert sorted(idx.keys()) == sorted(model)



def test_lengths_keep_u8_codes_until_the_table_is_full_then_widen() -> None:
    one = Lengths.of(np.full(1000, 2 << 20, np.uint32))
    assert one.codes.dtype == np.uint8 and one.nbytes == 1000 + 4 and one.at(7) == 2 << 20
    before = one
    one = one.replaced(np.array([3, 4]), np.array([5, 2 << 20], np.uint32))  # a second size: the table grows
    assert before.table is not None and len(before.table) == 1 and before.at(3) == 2 << 20  # never changed
    assert one.table is not None and list(one.table) == [5, 2 << 20] and one.at(3) == 5 and one.at(4) == 2 << 20
    assert int(one.decode()[999]) == 2 << 20
    vals = np.arange(1, MAX_CODES + 10, dtype=np.uint32)  # more distinct sizes than codes
    wide = one.append(vals)
    assert wide.table is None and wide.codes.dtype == np.uint32
    assert np.array_equal(wide.decode()[1000:], vals) and wide.at(3) == 5 and wide.at(0) == 2 << 20


def test_compact_index_with_many_record_sizes_matches_a_dict() -> None:
    """Through u8 codes, a growing table and the u32 fallback, every operation agrees with a dict."""
    rng = np.random.default_rng(2)
    idx, model = CompactObjectIndex(), {}
    keys = [rng.bytes(16) for _ in range(4000)]
    created = np.arange(10, dtype=np.float64)
    k0, k1 = split_keys(b"".join(keys[:1500]))
    obj = rng.integers(0, 10, 1500).astype(np.uint32)
    idx.merge(k0, k1, obj, np.arange(1500, dtype=np.uint32), np.full(1500, 4096, np.uint32), created)
    model.update({k: (int(obj[i]), i, 4096) for i, k in enumerate(keys[:1500])})
    assert idx.nbytes() <= 25 * 1500 + 64  # one record size: 25 B per block
    for round_, sizes in enumerate((3, 40, 400)):  # few sizes, more, more than the codes hold
        lo = 1500 + round_ * 800
        k0, k1 = split_keys(b"".join(keys[lo - 400:lo + 400]))  # half overwrite, half new
        ln = rng.integers(1, sizes + 1, 800).astype(np.uint32) * 512
        obj = np.full(800, 9 - round_, np.uint32)
        created[9 - round_] = 100 + round_  # newest: wins every overwrite
        idx.merge(k0, k1, obj, np.arange(800, dtype=np.uint32), ln, created)
        model.update({k: (9 - round_, i, int(ln[i])) for i, k in enumerate(keys[lo - 400:lo + 400])})
        for i, k in enumerate(keys[lo:lo + 300:3]):  # single puts, revives, removes
            idx.put(k, 1, i, 777 + round_)
            model[k] = (1, i, 777 + round_)
        for k in keys[lo - 400:lo:11]:
            assert idx.remove(k) == model.pop(k)
        assert all(idx.get(k) == v for k, v in model.items())
        idx.compact()
        assert len(idx) == len(model) and all(idx.get(k) == v for k, v in model.items())
    assert idx.len.table is None  # widened by the last round
    c0, c1, cobj, coff, cln = idx.columns()
    raw = join_keys(c0, c1)
    got = {raw[16 * i:16 * i + 16]: (int(o), int(f), int(n)) for i, (o, f, n) in enumerate(zip(cobj, coff, cln))}
    assert got == model

async def test_open_returns_at_once_and_serves_misses_until_ready(tmp_path: Path) -> None:
    w = await _tier(tmp_path, NS_A)
    recs = await _write(w, 4, b"a")
    r = ObjectTier(LocalDirBackend(tmp_path), namespace=NS_A)
    gate = asyncio.Event()
    real = r.backend.list

    async def slow_list(*a: object, **kw: object) -> object:
        await gate.wait()  # a huge bucket or a slow endpoint
        return await real(*a, **kw)  # type: ignore[arg-type]

    r.backend.list = slow_list  # type: ignore[method-assign]
    await asyncio.wait_for(r.open(), 0.5)
    assert not r.index_ready and not r.contains(recs[0][0])
    mine = await _write(r, 2, b"b")  # writes work while the index builds
    assert r.contains(mine[0][0])
    gate.set()
    assert await r.wait_ready(10)
    assert all(r.contains(k) for k, _ in recs + mine)
    for t in (w, r):
        await t.close()


async def test_a_namespace_never_requests_another(tmp_path: Path) -> None:
    a, b = await _tier(tmp_path, NS_A), await _tier(tmp_path, NS_B)
    ra, rb = await _write(a, 3, b"a"), await _write(b, 3, b"b")
    seen: list[str] = []
    be = LocalDirBackend(tmp_path)
    for m in ("get_range", "head", "list", "get_bytes", "put_object", "delete"):
        real = getattr(be, m)

        async def spy(name: str = "", *args: object, _real=real, **kw: object) -> object:
            seen.append(name)
            return await _real(name, *args, **kw)

        setattr(be, m, spy)
    c = ObjectTier(be, namespace=NS_A)
    await c.open()
    assert await c.wait_ready(10)
    await c.refresh()
    await c.refresh(full=False)
    assert all(c.contains(k) for k, _ in ra) and not any(c.contains(k) for k, _ in rb)
    assert seen and not [n for n in seen if n.startswith(ns_prefix(NS_B))]
    assert [n for n in seen if n.startswith(ns_prefix(NS_A))]
    for t in (a, b, c):
        await t.close()


async def test_snapshot_open_and_corrupt_snapshot_is_rebuilt(tmp_path: Path) -> None:
    w = await _tier(tmp_path, NS_A)
    recs = await _write(w, 5, b"s")
    assert await w.write_snapshot()
    later = await _write(w, 2, b"t")  # newer than the snapshot: found by the StartAfter listing
    r = await _tier(tmp_path, NS_A)
    assert r.stats.snapshot_loads == 1 and all(r.contains(k) for k, _ in recs + later)
    p = tmp_path / ns_prefix(NS_A) / SNAPSHOT_NAME
    raw = bytearray(p.read_bytes())
    raw[100] ^= 1
    try:
        decode(bytes(raw))
        raise AssertionError("a flipped bit must fail the checksum")
    except SnapshotError:
        pass
    p.write_bytes(raw)
    r2 = await _tier(tmp_path, NS_A)
    assert r2.stats.snapshot_rejected == 1 and all(r2.contains(k) for k, _ in recs + later)
    for t in (w, r, r2):
        await t.close()


async def test_legacy_root_layout_is_still_read_and_gc_covers_both(tmp_path: Path) -> None:
    old = await _tier(tmp_path, None)  # today's layout: manifests/ and data/ at the root
    legacy = await _write(old, 3, b"l")
    new = await _tier(tmp_path, NS_A)
    assert all(new.contains(k) for k, _ in legacy)
    buf = bytearray(len(legacy[0][1]))
    assert await new.read_into(legacy[0][0], memoryview(buf)) == len(buf) and bytes(buf) == legacy[0][1]
    mine = await _write(new, 2, b"n")
    rep = await gc_bucket(LocalDirBackend(tmp_path), ttl_s=None, grace_s=0)
    assert rep.deleted_data == 0 and rep.manifests == 2
    assert os.path.exists(tmp_path / ns_prefix(NS_A) / SNAPSHOT_NAME)
    again = await _tier(tmp_path, NS_A)
    assert all(again.contains(k) for k, _ in legacy + mine) and again.stats.snapshot_loads == 1
    for t in (old, new, again):
        await t.close()


async def test_a_delete_while_the_index_builds_survives_the_swap(tmp_path: Path) -> None:
    r = ObjectTier(LocalDirBackend(tmp_path), namespace=NS_A)
    gate = asyncio.Event()
    real = r.backend.list

    async def slow_list(*a: object, **kw: object) -> object:
        await gate.wait()
        return await real(*a, **kw)  # type: ignore[arg-type]

    r.backend.list = slow_list  # type: ignore[method-assign]
    await r.open()
    (gone, _), (kept, _) = await _write(r, 2, b"d")  # written while the index builds ...
    assert await r.delete(gone)  # ... and one deleted before it is swapped in
    gate.set()
    assert await r.wait_ready(10)
    assert not r.contains(gone) and r.contains(kept)
    await r.close()
