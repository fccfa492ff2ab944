"""Tenants in the object tier: per-tenant accounting from manifests (every node's view), quotas in
capacity enforcement, index snapshots that carry tenants, and the conformance tenant-usage test."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.errors import TierFull
from dynamo_tiered_kv.policy.quotas import TenantQuotas
from dynamo_tiered_kv.testing.records import make_record, random_key
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend
from dynamo_tiered_kv.tiers.objectstore import snapshot as sn
from dynamo_tiered_kv.tiers.objectstore.index import ObjectTable
from dynamo_tiered_kv.tiers.objectstore.layout import SNAPSHOT_NAME
from dynamo_tiered_kv.tiers.objectstore.manifest import Manifest
from dynamo_tiered_kv.tiers.objectstore.tenancy import MIXED, TenantBook, capacity_victims
from tests import test_objectstore_conformance as conformance  # a module: its classes are not collected here

pytest_plugins = ["infra.fixtures_s3"]

T1, T2, T3 = (bytes([n]) * 8 for n in (1, 2, 3))


def _recs(n: int, tenant: bytes, tag: bytes, seed: int = 0) -> list[tuple[bytes, bytes]]:
    return [(k, make_record(k, seed + i, tenant=tenant)) for i, k in enumerate(random_key(i, tag) for i in range(n))]


def _usage(*groups: list[tuple[bytes, bytes]], tenants: tuple[bytes, ...]) -> dict[bytes, tuple[int, int]]:
    out: dict[bytes, tuple[int, int]] = {}
    for recs, t in zip(groups, tenants, strict=True):
        b, c = out.get(t, (0, 0))
        out[t] = (b + sum(len(v) for _, v in recs), c + len(recs))
    return out


async def _open(tier: ObjectTier) -> ObjectTier:
    await tier.open()
    assert await tier.wait_ready(30)
    return tier


async def _run_conformance(case: object, tmp_path: Path) -> None:
    try:
        await case.test_tenant_usage_counts_each_tenants_records(tmp_path)  # type: ignore[attr-defined]
    except pytest.skip.Exception:
        pytest.fail("the object tier must account by tenant (tenant_usage returned None)")


async def test_conformance_tenant_usage_runs_for_the_object_tier_on_a_local_dir(tmp_path: Path) -> None:
    await _run_conformance(conformance.TestObjectTierLocalDir(), tmp_path)


async def test_conformance_tenant_usage_runs_for_the_object_tier_on_moto(tmp_path: Path, moto_s3: S3Server) -> None:
    case = conformance.TestObjectTierMoto()
    case.server, case.buckets = moto_s3, {}
    await _run_conformance(case, tmp_path)


async def test_a_flooding_tenant_cannot_evict_another_tenants_objects_within_its_quota(tmp_path: Path) -> None:
    one = len(_recs(1, T1, b"x")[0][1])
    cap = 20 * one
    tier = await _open(ObjectTier(LocalDirBackend(tmp_path), capacity_bytes=cap,
                                  quotas=TenantQuotas(cap, default_share=0.5)))
    quiet = _recs(6, T1, b"quiet")  # 6 of its 10 records' worth of quota
    for k, v in quiet:
        await tier.write(k, memoryview(v))
    flood = _recs(40, T2, b"flood", seed=100)
    for k, v in flood:
        await tier.write(k, memoryview(v))
        use = tier.tenant_usage()
        assert use.get(T2, (0, 0))[0] <= cap // 2 and tier.usage().used_bytes <= cap
    assert all(tier.contains(k) for k, _ in quiet)
    assert tier.tenant_usage() == {T1: (6 * one, 6), T2: (10 * one, 10)}
    assert all(tier.contains(k) for k, _ in flood[-10:])  # the flooder lost its own oldest
    assert not any(tier.contains(k) for k, _ in flood[:30])
    assert tier.tenant_limit(T2.hex()) == cap // 2 and tier.tenant_limit("not hex") == cap // 2
    with pytest.raises(TierFull):  # one run past the tenant's quota is refused whole
        await tier.write_many((k, memoryview(v)) for k, v in _recs(11, T3, b"big"))
    await tier.close()


def test_a_full_namespace_drops_objects_of_tenants_over_their_limit_before_older_ones() -> None:
    """Objects of a tenant still over its limit (its own objects cannot bring it under: its
    records sit in a mixed object) go before an older object of a tenant within its limit."""
    book = TenantBook()
    c1, c2 = book.code_of(T1), book.code_of(T2)
    view = np.zeros(3, ObjectTable.DTYPE)
    view["created"] = [1.0, 2.0, 3.0]
    view["live"] = [100, 100, 100]
    view["ten"] = [c1, MIXED, c2]  # oldest: tenant 1 (within), then a mixed object, then tenant 2's
    book.mixed[1] = (np.array([0, 50], np.uint32), np.array([c2, c2], np.uint16))
    book.count(c1, 100, 1)
    book.count(c2, 200, 3)
    quotas = TenantQuotas(1000, limits={T1: 500, T2: 120})
    got = capacity_victims(book, view, 300, 200, quotas, None)
    assert got.tolist() == [2]  # tenant 2's own object; the namespace is within capacity after it
    got = capacity_victims(book, view, 300, 50, quotas, None)
    assert got.tolist()[0] == 2 and 0 in got.tolist()  # then the plain order, oldest first
    book2 = TenantBook()
    book2.code_of(T1)
    book2.code_of(T2)
    book2.count(c1, 100, 1)
    book2.count(c2, 200, 3)
    view2 = view.copy()
    view2["ten"] = [c1, c2, c1]
    got = capacity_victims(book2, view2, 300, 250, TenantQuotas(1000, limits={T2: 150}), None)
    assert got.tolist() == [1]  # tenant 2 is over: its object goes though tenant 1's is older


async def test_a_second_node_sees_every_tenants_bytes_and_enforces_quotas_on_its_view(tmp_path: Path) -> None:
    a = await _open(ObjectTier(LocalDirBackend(tmp_path)))
    b = await _open(ObjectTier(LocalDirBackend(tmp_path)))
    r1, r2 = _recs(4, T1, b"a"), _recs(3, T2, b"b")
    await a.write_many((k, memoryview(v)) for k, v in r1)
    for k, v in r2:
        await a.write(k, memoryview(v))
    mixed = [_recs(1, T1, b"m1", 50)[0], _recs(1, T3, b"m3", 60)[0]]  # one object, two tenants
    await a.write_many((k, memoryview(v)) for k, v in mixed)
    want = _usage(r1 + mixed[:1], r2, mixed[1:], tenants=(T1, T2, T3))
    assert a.tenant_usage() == want
    await b.refresh(full=False)
    assert b.tenant_usage() == want
    assert await b.delete(mixed[1][0])  # a record of the mixed object, on b only
    assert b.tenant_usage() == _usage(r1 + mixed[:1], r2, tenants=(T1, T2))
    one = len(r2[0][1])
    limited = await _open(ObjectTier(LocalDirBackend(tmp_path), quotas=TenantQuotas(1 << 40, limits={T2: one})))
    assert limited.tenant_usage()[T2] == (one, 1)  # its view: tenant 2 kept its newest record only
    assert limited.contains(r2[-1][0]) and not limited.contains(r2[0][0])
    await limited.close()
    await a.refresh(full=True)  # the manifests it deleted are gone for every node
    assert a.tenant_usage()[T2] == (one, 1) and a.tenant_usage()[T1] == want[T1]
    for t in (a, b):
        await t.close()


async def test_the_index_snapshot_carries_tenants_and_an_older_one_falls_back_to_the_manifests(
        tmp_path: Path) -> None:
    w = await _open(ObjectTier(LocalDirBackend(tmp_path)))
    r1, r2 = _recs(3, T1, b"s1"), _recs(2, T2, b"s2")
    mixed = [_recs(1, T2, b"m2", 70)[0], _recs(1, T3, b"m3", 80)[0], _recs(1, T1, b"m1", 90)[0]]
    await w.write_many((k, memoryview(v)) for k, v in r1)
    await w.write_many((k, memoryview(v)) for k, v in r2)
    await w.write_many((k, memoryview(v)) for k, v in mixed)
    want = w.tenant_usage()
    assert want == _usage(r1 + mixed[2:], r2 + mixed[:1], mixed[1:2], tenants=(T1, T2, T3))
    assert await w.write_snapshot()
    await w.close()
    snap = sn.decode((tmp_path / SNAPSHOT_NAME).read_bytes())
    assert snap.tenants is not None and snap.object_tenants is not None and snap.mixed is not None
    assert len(snap.mixed) == 3 and int(np.count_nonzero(snap.object_tenants == sn.MIXED_CODE)) == 1
    originals = {p: p.read_bytes() for p in (tmp_path / "manifests").iterdir()}
    for p, raw in originals.items():  # only the snapshot can tell the tenants now
        p.write_bytes(dataclasses.replace(m := Manifest.from_bytes(raw), entries=tuple(
            dataclasses.replace(e, tenant=bytes(8)) for e in m.entries)).to_bytes())
    r = await _open(ObjectTier(LocalDirBackend(tmp_path)))
    assert r.stats.snapshot_loads == 1 and r.tenant_usage() == want
    assert await r.delete(mixed[1][0])  # the mixed object's records keep their tenants after the load
    assert T3 not in r.tenant_usage() and r.tenant_usage()[T2] == want[T2]
    await r.close()

    # a snapshot written before tenants (version 2) is not started from: the manifests are listed
    for p, raw in originals.items():
        p.write_bytes(raw)
    old = dataclasses.replace(snap, tenants=None, object_tenants=None, mixed=None)
    raw2 = sn.encode(old)
    assert int.from_bytes(raw2[8:12], "little") == 2
    (tmp_path / SNAPSHOT_NAME).write_bytes(raw2)
    r2 = await _open(ObjectTier(LocalDirBackend(tmp_path)))
    assert r2.stats.snapshot_loads == 0 and r2.stats.snapshot_rejected == 1 and r2.tenant_usage() == want
    await r2.close()


def test_a_snapshot_whose_mixed_rows_miss_a_record_is_rejected() -> None:
    objects = np.zeros(1, sn.OBJ_DTYPE)
    k0, k1 = np.array([1, 2], np.uint64), np.array([0, 0], np.uint64)
    base = sn.Snapshot(objects, {}, k0, k1, np.zeros(2, np.uint32), np.array([0, 4096], np.uint32),
                       np.full(2, 4096, np.uint32), 0, tenants=[bytes(8), T1],
                       object_tenants=np.array([sn.MIXED_CODE], np.uint32),
                       mixed=sn.mixed_rows([(0, np.array([0, 4096]), np.array([0, 1]))]))
    assert sn.decode(sn.encode(base)).tenants == [bytes(8), T1]
    short = dataclasses.replace(base, mixed=sn.mixed_rows([(0, np.array([0]), np.array([1]))]))
    with pytest.raises(sn.SnapshotError):
        sn.decode(sn.encode(short))
    bad_code = dataclasses.replace(base, object_tenants=np.array([7], np.uint32), mixed=sn.mixed_rows([]))
    with pytest.raises(sn.SnapshotError):
        sn.decode(sn.encode(bad_code))


async def test_a_nodes_overwrites_within_one_second_keep_their_order_on_s3(moto_s3: S3Server) -> None:
    """S3 mtimes have whole seconds: a node's later publish must still be the newest for every
    other node (and after a restart), so the overwrite's tenant and bytes are what is counted."""
    bucket = unique_bucket()
    t = await _open(ObjectTier(S3Backend(bucket, "kv/", **moto_s3.backend_kwargs())))
    first, second = _recs(8, T1, b"o"), _recs(8, T2, b"o", seed=500)
    for (k, v), (_, v2) in zip(first, second, strict=True):
        await t.write(k, memoryview(v))
        await t.write(k, memoryview(v2))
    await t.close()
    r = await _open(ObjectTier(S3Backend(bucket, "kv/", **moto_s3.backend_kwargs())))
    assert r.tenant_usage() == _usage(second, tenants=(T2,))
    await r.close()


def test_the_settings_reach_the_object_tier_built_from_config(tmp_path: Path) -> None:
    from dynamo_tiered_kv.blocks.keys import Namespace
    from dynamo_tiered_kv.blocks.tenant import DEFAULT_TENANT, parse_tenant
    from dynamo_tiered_kv.config import TieredKVConfig
    from dynamo_tiered_kv.factory import build_store

    cap = 64 << 20
    cfg = TieredKVConfig.from_mapping({
        "host_capacity_bytes": 0, "object_url": f"file://{tmp_path}", "object_capacity_bytes": cap,
        "staging_slab_bytes": 1 << 20, "staging_slabs": 2, "tenant_default_share": 0.5,
        "tenant_quotas": {"acme": {"object": "8MiB"}}})
    store = build_store(cfg, Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 2, 2, 32))
    try:
        obj = store.tiers[0]
        assert isinstance(obj, ObjectTier)
        assert obj.tenant_limit(parse_tenant("acme", deployment_salt="").hex()) == 8 << 20
        assert obj.tenant_limit(DEFAULT_TENANT.hex()) == cap // 2
    finally:
        store.close()
