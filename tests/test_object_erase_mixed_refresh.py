"""A node keeps its object index after an erase rewrote an object that mixed tenants: the old
object leaves its view (its records' tenants with it), the rewritten one enters, and the node's
per-tenant totals name only the tenants still in the bucket."""

from __future__ import annotations

from pathlib import Path

from dynamo_tiered_kv.testing.records import make_record, random_key
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.tenants import erase_tenant_objects

T1, T2, T3 = (bytes([n]) * 8 for n in (1, 2, 3))


def _recs(n: int, tenant: bytes, tag: bytes, seed: int = 0) -> list[tuple[bytes, bytes]]:
    return [(k, make_record(k, seed + i, tenant=tenant)) for i, k in enumerate(random_key(i, tag) for i in range(n))]


async def test_a_refresh_after_an_erase_rewrote_a_mixed_object_keeps_the_index(tmp_path: Path) -> None:
    a = ObjectTier(LocalDirBackend(tmp_path))
    b = ObjectTier(LocalDirBackend(tmp_path))
    for t in (a, b):
        await t.open()
        assert await t.wait_ready(30)
    mixed = _recs(2, T1, b"m1") + _recs(2, T3, b"m3", 10)  # one object, two tenants
    other = _recs(2, T2, b"b", 20)
    await a.write_many((k, memoryview(v)) for k, v in mixed)
    await a.write_many((k, memoryview(v)) for k, v in other)
    await b.refresh(full=True)
    assert set(b.tenant_usage()) == {T1, T2, T3}
    eraser = LocalDirBackend(tmp_path)
    await eraser.open()
    rep = await erase_tenant_objects(eraser, T1)  # T3's records move to a new object
    await eraser.close()
    assert rep.records == 2 and rep.rewritten_manifests == 1
    for t in (b, a):  # b only listed the old object; a wrote it
        await t.refresh(full=True)
        usage = t.tenant_usage()
        assert usage.get(T1, (0, 0)) == (0, 0)
        assert usage[T3] == (sum(len(v) for _, v in mixed[2:]), 2) and usage[T2][1] == 2
        assert all(t.contains(k) for k, _ in mixed[2:] + other)
        assert not any(t.contains(k) for k, _ in mixed[:2])
    for t in (a, b):
        await t.close()
