"""Per-tenant quotas (policy/quotas.py): a tenant at its limit evicts its own blocks, never another
tenant's blocks held within that tenant's limit; without quotas the same flood evicts everyone."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_tiered_kv.blocks.tenant import tenant_id
from dynamo_tiered_kv.errors import TierFull
from dynamo_tiered_kv.policy.quotas import TenantLedger, TenantQuotas
from dynamo_tiered_kv.testing.records import make_record
from dynamo_tiered_kv.tiers.host import HostTier

A, B, C = (tenant_id(n, deployment_salt="q") for n in ("alice", "bob-the-flooder", "carol"))
REC = len(make_record(b"k" * 16))
CHUNK = 4096


def _key(tenant: bytes, i: int) -> bytes:
    return tenant + i.to_bytes(8, "little")


def _host(records: int, quotas: TenantQuotas | None) -> HostTier:
    return HostTier(records * REC, chunk_bytes=CHUNK, quotas=quotas)


def _write(tier: HostTier, tenant: bytes, i: int) -> None:
    tier.write_sync(_key(tenant, i), memoryview(make_record(_key(tenant, i), i, tenant=tenant)))


def test_a_flooding_tenant_evicts_only_its_own_blocks() -> None:
    tier = _host(12, TenantQuotas(12 * REC, default_share=0.25, limits={A: 5 * REC}))
    for i in range(5):
        _write(tier, A, i)
    for i in range(3):
        _write(tier, C, i)
    for i in range(200):
        _write(tier, B, i)
    assert all(tier.contains(_key(A, i)) for i in range(5)), "the flooder evicted another tenant's blocks"
    assert all(tier.contains(_key(C, i)) for i in range(3))
    held = tier.ledger.snapshot()
    assert held[B] == (3 * REC, 3)  # B at its limit: a quarter of 12 records
    assert tier.contains(_key(B, 199)) and not tier.contains(_key(B, 0))  # B's own LRU went first
    assert held[A] == (5 * REC, 5) and held[C] == (3 * REC, 3)


def test_without_quotas_the_same_flood_evicts_everyone() -> None:
    tier = _host(12, None)
    for i in range(4):
        _write(tier, A, i)
    for i in range(200):
        _write(tier, B, i)
    assert not any(tier.contains(_key(A, i)) for i in range(4))


def test_explicit_limits_and_the_default_share() -> None:
    q = TenantQuotas(100 * REC, default_share=0.1, limits={A: 50 * REC, C: 10**15})
    assert q.limit(A) == 50 * REC and q.limit(B) == 10 * REC and q.limit(C) == 100 * REC
    assert q.enforced and not TenantQuotas(100, default_share=1.0).enforced
    with pytest.raises(ValueError):
        TenantQuotas(100, default_share=0.0)
    with pytest.raises(ValueError):
        TenantQuotas(100, limits={b"short": 1})


def test_a_record_larger_than_its_tenants_quota_is_refused() -> None:
    tier = _host(12, TenantQuotas(12 * REC, limits={A: REC // 2}))
    with pytest.raises(TierFull):
        _write(tier, A, 0)
    _write(tier, B, 0)
    assert tier.contains(_key(B, 0)) and tier.usage().num_blocks == 1


def test_a_tenant_at_its_limit_keeps_its_retained_blocks_and_drops_its_others() -> None:
    tier = _host(12, TenantQuotas(12 * REC, default_share=0.25))  # 3 records each
    cls = tier.configure_retention(max_share=0.5, clock=lambda: 0.0)
    _write(tier, A, 0)
    cls.set(_key(A, 0), 50, None, REC, holder=(A.hex(), None))
    for i in range(1, 10):
        _write(tier, A, i)
    assert tier.contains(_key(A, 0)), "the tenant's retained block went before its ordinary ones"
    assert tier.ledger.bytes_of(A) <= 3 * REC


def test_the_ledger_counts_bytes_and_blocks_and_forgets_empty_tenants() -> None:
    led = TenantLedger()
    led.add(A, 10)
    led.add(A, 5)
    led.add(B, 7)
    assert led.snapshot() == {A: (15, 2), B: (7, 1)}
    assert led.over(TenantQuotas(20, limits={A: 12, B: 7})) == [A]
    led.remove(A, 10)
    led.remove(A, 5)
    assert led.snapshot() == {B: (7, 1)} and led.bytes_of(A) == 0


def test_deletes_and_overwrites_keep_the_ledger_exact() -> None:
    tier = _host(12, TenantQuotas(12 * REC, default_share=0.5))
    for i in range(3):
        _write(tier, A, i)
    _write(tier, A, 1)  # overwrite
    asyncio.run(tier.delete(_key(A, 2)))
    assert tier.ledger.snapshot() == {A: (2 * REC, 2)}
    asyncio.run(tier.close())
    assert tier.ledger.snapshot() == {}


def test_quotas_charge_whole_chunks_so_limits_that_add_up_to_the_arena_fit_in_it() -> None:
    """Records that fill half a chunk still take a whole one: charging record bytes would let two
    tenants' limits (half the arena each) need twice the arena, and the flood would then evict the
    other tenant through the plain LRU order."""
    tier = HostTier(8 * 2 * REC, chunk_bytes=2 * REC, quotas=TenantQuotas(8 * 2 * REC, default_share=0.5))
    for i in range(4):
        _write(tier, A, i)
    for i in range(50):
        _write(tier, B, i)
    assert all(tier.contains(_key(A, i)) for i in range(4)), "the flood evicted a tenant within its quota"
    assert tier.tenant_usage()[B] == (4 * REC, 4)  # four records: eight chunks' worth of its limit
