"""Tenants in the SSD tier (tiers/ssd/tenancy.py): an exact per-tenant ledger through writes,
overwrites, deletes, eviction and recovery; quotas under which a tenant over its limit evicts its
own segments and a flood never evicts another tenant's blocks held within that tenant's limit."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.codec import record_tenant
from dynamo_tiered_kv.blocks.tenant import DEFAULT_TENANT, tenant_id
from dynamo_tiered_kv.errors import TierFull
from dynamo_tiered_kv.policy.quotas import TenantQuotas
from dynamo_tiered_kv.testing import make_record, small_shape
from dynamo_tiered_kv.testing.clock import ManualClock
from dynamo_tiered_kv.testing.ssd import open_ssd_tier
from dynamo_tiered_kv.testing.ssd import read_whole as read
from dynamo_tiered_kv.tiers.ssd import SSDTier
from dynamo_tiered_kv.tiers.ssd.segment import ONE_TENANT, list_segments, read_footer

A, B, C = (tenant_id(n, deployment_salt="ssd-q") for n in ("alice", "bob-the-flooder", "carol"))
SHAPE = small_shape(num_layers=2)  # 12 KiB records
REC = len(make_record(b"k" * 16, shape=SHAPE))
CAP = 96 * REC  # 1.125 MiB; segments are clamped to a quarter of it


def key(tenant: bytes, i: int) -> bytes:
    return tenant + i.to_bytes(8, "little")


def record(tenant: bytes, i: int, seed: int = 0) -> bytes:
    return make_record(key(tenant, i), seed * 10_007 + i, shape=SHAPE, tenant=tenant)


async def write(t: SSDTier, tenant: bytes, ids: range, seed: int = 0) -> None:
    await t.write_many([(key(tenant, i), memoryview(record(tenant, i, seed))) for i in ids])


async def held(t: SSDTier) -> dict[bytes, tuple[int, int]]:
    """What the tier serves per tenant, worked out by reading every record's header."""
    out: dict[bytes, tuple[int, int]] = {}
    for k in list(t.keys()):
        rec = await read(t, k)
        assert rec is not None
        tenant = record_tenant(rec)
        b, c = out.get(tenant, (0, 0))
        out[tenant] = (b + len(rec), c + 1)
    return out


async def tier(path: Path, quotas: TenantQuotas | None, **kw) -> SSDTier:
    kw.setdefault("capacity_bytes", CAP)
    return await open_ssd_tier(path, quotas=quotas, **kw)


# --- quotas -----------------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", [False, True])
async def test_a_flood_never_evicts_another_tenants_blocks_within_its_quota(tmp_path: Path,
                                                                          interleaved: bool) -> None:
    q = TenantQuotas(CAP, limits={A: CAP // 3, B: CAP // 3, C: CAP // 3})
    t = await tier(tmp_path, q)
    try:
        await write(t, A, range(20))  # 240 KiB of A's 384 KiB
        await write(t, C, range(5))
        for step in range(40):  # B writes 8x the capacity, far past its limit
            await write(t, B, range(step * 6, step * 6 + 6))
            if interleaved:  # another tenant's writes in between: one tenant per segment still
                await write(t, C, range(5 + step % 3, 6 + step % 3))
        for i in range(20):
            assert await read(t, key(A, i)) == record(A, i), f"the flood evicted A's block {i}"
        for i in range(5):
            assert await read(t, key(C, i)) == record(C, i)
        usage = t.tenant_usage()
        assert usage == await held(t)
        assert usage[A] == (20 * REC, 20)
        assert usage[B][0] <= CAP // 3
        assert await read(t, key(B, 239)) == record(B, 239)  # B's newest stay, its oldest went
        assert not t.contains(key(B, 0))
        assert t.usage().used_bytes <= CAP
    finally:
        await t.close()


async def test_without_quotas_the_same_flood_evicts_the_other_tenant(tmp_path: Path) -> None:
    t = await tier(tmp_path, None)
    try:
        await write(t, A, range(20))
        for step in range(40):
            await write(t, B, range(step * 6, step * 6 + 6))
        assert not any(t.contains(key(A, i)) for i in range(20))
        assert t.tenant_usage() == await held(t)
    finally:
        await t.close()


async def test_a_tenant_over_its_quota_evicts_its_own_segments_before_the_tier_is_full(tmp_path: Path) -> None:
    q = TenantQuotas(CAP, default_share=0.25)
    t = await tier(tmp_path, q)
    try:
        await write(t, A, range(10))
        for step in range(10):
            await write(t, B, range(step * 4, step * 4 + 4))  # 40 records: past a quarter (24)
        usage = t.tenant_usage()
        assert usage[B][0] <= CAP // 4 < 40 * REC
        assert usage[A] == (10 * REC, 10)
        assert t.usage().used_bytes < CAP // 2 + 2 * (CAP // 16)  # nobody else's room was taken
    finally:
        await t.close()


async def test_a_full_tier_evicts_a_tenant_over_its_lowered_quota_not_an_older_tenant_within_its_own(
        tmp_path: Path) -> None:
    t = await tier(tmp_path, None)
    try:
        await write(t, C, range(20))  # C's segments are the least recently used
        await t.seal()
        await write(t, A, range(40))
        await t.seal()
    finally:
        await t.close()
    q = TenantQuotas(CAP, limits={A: CAP // 4, B: CAP // 2, C: CAP // 4})  # A is now far over its limit
    t = await tier(tmp_path, q)
    try:
        for step in range(10):
            await write(t, B, range(step * 4, step * 4 + 4))
        for i in range(20):
            assert await read(t, key(C, i)) == record(C, i), f"C lost block {i} while A was over its quota"
        assert t.tenant_usage()[A][1] < 40
        assert all(t.contains(key(B, i)) for i in range(40))
        assert t.tenant_usage() == await held(t)
    finally:
        await t.close()


async def test_a_record_larger_than_its_tenants_quota_is_refused_and_nothing_is_lost(tmp_path: Path) -> None:
    q = TenantQuotas(CAP, limits={B: REC})
    t = await tier(tmp_path, q)
    try:
        await write(t, A, range(3))
        with pytest.raises(TierFull, match="quota"):
            await write(t, B, range(1))
        assert t.tenant_usage() == {A: (3 * REC, 3)}
    finally:
        await t.close()


async def test_a_tenants_retained_blocks_survive_its_own_flood(tmp_path: Path) -> None:
    q = TenantQuotas(CAP, limits={A: CAP // 2})
    t = await tier(tmp_path, q)
    table = t.configure_retention(max_share=0.5, clock=time.time)
    try:
        await write(t, A, range(8))
        for i in range(8):
            assert table.set(key(A, i), 50, None, REC, holder=(A.hex(), "session"))
        await t.seal()
        await write(t, A, range(100, 108))  # ordinary blocks, older than the flood
        for step in range(30):
            await write(t, A, range(200 + step * 4, 204 + step * 4))
        for i in range(8):
            assert await read(t, key(A, i)) == record(A, i), f"retained block {i} lost to its own tenant's flood"
        assert not any(t.contains(key(A, i)) for i in range(100, 108))  # its unprotected ones went first
        assert t.tenant_usage()[A][0] <= CAP // 2
    finally:
        await t.close()


async def test_a_tenants_expired_blocks_go_before_its_older_ordinary_ones(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    q = TenantQuotas(CAP, limits={A: CAP // 2})
    t = await tier(tmp_path, q)
    table = t.configure_retention(max_share=0.5, clock=clock)
    try:
        await write(t, A, range(8))  # ordinary, oldest
        await t.seal()
        await write(t, A, range(100, 108))
        for i in range(100, 108):
            table.set(key(A, i), 50, 1010.0, REC, holder=(A.hex(), "session"))
        await t.seal()
        clock.t += 60  # their retention lapsed: expired blocks go before every other
        await write(t, A, range(200, 216))
        for step in range(4):  # just enough to pass A's limit: one segment has to go
            await write(t, A, range(300 + step * 4, 304 + step * 4))
        assert not any(t.contains(key(A, i)) for i in range(100, 108))
        assert all(t.contains(key(A, i)) for i in range(8))
    finally:
        await t.close()


# --- the ledger -------------------------------------------------------------------------------
@pytest.mark.parametrize("quotas", [False, True], ids=["mixed-segments", "one-tenant-segments"])
async def test_ledger_is_exact_through_overwrites_deletes_eviction_and_recovery(tmp_path: Path, quotas: bool) -> None:
    q = TenantQuotas(CAP, limits={A: CAP // 2, B: CAP // 4, C: CAP // 4}) if quotas else None
    t = await tier(tmp_path, q)
    try:
        for step in range(6):  # interleaved tenants
            for tenant in (A, B, C):
                await write(t, tenant, range(step * 3, step * 3 + 3))
        assert t.tenant_usage() == await held(t)
        await write(t, A, range(0, 6), seed=1)  # overwrites
        await t.write(key(B, 1), memoryview(record(C, 1)))  # a key now holding another tenant's record
        assert await t.delete_many([key(A, 7), key(C, 2), key(B, 4)]) == 3
        await t.seal()
        assert await t.delete(key(A, 8))
        assert t.tenant_usage() == await held(t) != {}
        for step in range(20):  # eviction
            await write(t, DEFAULT_TENANT, range(step * 4, step * 4 + 4))
        before = t.tenant_usage()
        assert before == await held(t)
        assert sum(n for n, _ in before.values()) <= t.usage().used_bytes <= CAP
        await t.close()
        t = await tier(tmp_path, q)
        assert t.tenant_usage() == before == await held(t)  # recovery
    finally:
        await t.close()


async def test_recovery_names_the_tenant_of_a_one_tenant_segment_whose_first_record_was_punched(
        tmp_path: Path) -> None:
    t = await tier(tmp_path, TenantQuotas(CAP, default_share=0.5))
    try:
        await write(t, A, range(6))
        sealed = await t.seal()
        assert sealed is not None
        await write(t, B, range(3))
        await t.seal()
        assert await t.delete(key(A, 0))  # punched out of the sealed segment: reads as zeros now
        path = sealed.path
        fd = os.open(path, os.O_RDONLY)
        try:
            footer = read_footer(fd, os.fstat(fd).st_size)
            assert footer is not None and footer.flags & ONE_TENANT
            if os.pread(fd, 8, 0) != bytes(8):
                pytest.skip("this filesystem does not punch holes")
        finally:
            os.close(fd)
        await t.close()
        t = await tier(tmp_path, TenantQuotas(CAP, default_share=0.5))
        assert t.tenant_usage() == {A: (5 * REC, 5), B: (3 * REC, 3)}
    finally:
        await t.close()


async def test_segments_sealed_before_the_tenant_flag_are_read_record_by_record(tmp_path: Path) -> None:
    t = await tier(tmp_path, None)
    try:
        await t.write_many([(key(A, 0), memoryview(record(A, 0))), (key(B, 0), memoryview(record(B, 0))),
                            (key(A, 1), memoryview(record(A, 1)))])
        await t.seal()
        await write(t, C, range(2))
        await t.seal()
    finally:
        await t.close()
    flags = []
    for _, path in list_segments(tmp_path / "rank-000"):
        fd = os.open(path, os.O_RDONLY)
        try:
            footer = read_footer(fd, os.fstat(fd).st_size)
            assert footer is not None
            flags.append(footer.flags)
        finally:
            os.close(fd)
    assert flags == [0, ONE_TENANT]  # mixed, then one tenant
    t = await tier(tmp_path, None)
    try:
        assert t.tenant_usage() == {A: (2 * REC, 2), B: (REC, 1), C: (2 * REC, 2)}
    finally:
        await t.close()


def test_tenant_limit_is_the_quota_or_the_capacity(tmp_path: Path) -> None:
    with_q = SSDTier(tmp_path / "q", capacity_bytes=CAP, quotas=TenantQuotas(CAP, limits={A: CAP // 8}))
    without = SSDTier(tmp_path / "n", capacity_bytes=CAP)
    assert with_q.tenant_limit(A.hex()) == CAP // 8
    assert with_q.tenant_limit(B.hex()) == CAP
    assert without.tenant_limit(A.hex()) == CAP


def test_the_settings_reach_the_ssd_tier_built_from_config(tmp_path: Path) -> None:
    from dynamo_tiered_kv.blocks.keys import Namespace
    from dynamo_tiered_kv.blocks.tenant import parse_tenant
    from dynamo_tiered_kv.config import TieredKVConfig
    from dynamo_tiered_kv.factory import build_store

    cap = 64 << 20
    cfg = TieredKVConfig.from_mapping({
        "host_capacity_bytes": 0, "ssd_dir": str(tmp_path), "ssd_capacity_bytes": cap, "staging_slab_bytes": 1 << 20,
        "staging_slabs": 2, "tenant_default_share": 0.5, "tenant_quotas": {"acme": {"ssd": "8MiB"}}})
    store = build_store(cfg, Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 2, 2, 32))
    try:
        ssd = store.tiers[0]
        assert isinstance(ssd, SSDTier)
        acme = parse_tenant("acme", deployment_salt="")
        assert ssd.tenant_limit(acme.hex()) == 8 << 20
        assert ssd.tenant_limit(DEFAULT_TENANT.hex()) == cap // 2
    finally:
        store.close()
