"""A node applies cluster-wide tenant erasures (store/erasure.py): once any tier reports a tenant
erased, every tier drops that tenant's blocks (the host tier by its tenant index, other tiers by
the contract's default that reads record headers), other tenants keep theirs, the residency hook
hears of it, and a later erase of the same tenant is applied again."""

from __future__ import annotations

import asyncio
import time

from dynamo_tiered_kv.blocks.tenant import tenant_id
from dynamo_tiered_kv.store.erasure import ErasureService
from dynamo_tiered_kv.testing.records import make_record
from dynamo_tiered_kv.tiers.host import HostTier

A, B = tenant_id("alice"), tenant_id("bob")
REC = len(make_record(b"k" * 16))


class _Bucketish(HostTier):
    """A host tier that knows erasures (as the object tier does) and is erased through the
    contract's default (record headers), not the host tier's tenant index."""

    def __init__(self) -> None:
        super().__init__(16 * REC, chunk_bytes=4096)
        self.marks: dict[bytes, float] = {}

    def erasures(self) -> dict[bytes, float]:
        return dict(self.marks)

    async def erase_tenant(self, tenant: bytes) -> int:
        from dynamo_tiered_kv.tiers.base import Tier

        return await Tier.erase_tenant(self, tenant)


class _State:
    def __init__(self, tiers) -> None:
        self.tiers = tiers


class _Hook:
    def __init__(self) -> None:
        self.gone: list[bytes] = []

    def evicted(self, keys) -> None:
        self.gone += list(keys)

    def flushed(self, keys) -> None:
        pass


def _key(tenant: bytes, i: int) -> bytes:
    return tenant + i.to_bytes(8, "little")


def _fill(tier: HostTier) -> None:
    for t in (A, B):
        for i in range(4):
            tier.write_sync(_key(t, i), memoryview(make_record(_key(t, i), i, tenant=t)))


def test_an_erasure_reported_by_one_tier_drops_the_tenant_from_every_tier() -> None:
    host, bucket = HostTier(16 * REC, chunk_bytes=4096), _Bucketish()
    _fill(host)
    _fill(bucket)
    hook = _Hook()
    host.set_residency_hook(hook)
    svc = ErasureService(_State([host, bucket]), interval_s=0.1)
    assert asyncio.run(svc.apply()) == 0  # nothing erased yet
    bucket.marks[A] = time.time()
    assert asyncio.run(svc.apply()) == 8
    for tier in (host, bucket):
        assert not any(tier.contains(_key(A, i)) for i in range(4))
        assert all(tier.contains(_key(B, i)) for i in range(4))
    assert host.tenant_usage() == {B: (4 * REC, 4)}
    assert sorted(hook.gone) == sorted(_key(A, i) for i in range(4))
    assert asyncio.run(svc.apply()) == 0  # applied once
    host.write_sync(_key(A, 9), memoryview(make_record(_key(A, 9), 9, tenant=A)))
    bucket.marks[A] += 10  # erased again later: applied again
    assert asyncio.run(svc.apply()) == 1 and not host.contains(_key(A, 9))
