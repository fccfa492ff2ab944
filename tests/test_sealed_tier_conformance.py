"""The sealed SSD tier (encryption at rest) against the shared conformance suite: every contract
member the store relies on behaves as on the plain tier, while the bytes on disk are sealed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dynamo_tiered_kv.blocks.sealed import is_sealed
from dynamo_tiered_kv.tenants.cipher import RecordCipher
from dynamo_tiered_kv.tenants.sealed_tier import SealedTier
from dynamo_tiered_kv.testing import TierConformanceTests
from dynamo_tiered_kv.testing.records import make_record
from dynamo_tiered_kv.tiers.ssd import SSDTier

KEY = bytes(range(32))


class TestSealedSSDTier(TierConformanceTests):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> SealedTier:
        ssd = SSDTier(tmp_path, capacity_bytes=capacity_bytes, segment_bytes=256 << 10, idle_seal_s=None)
        return SealedTier(ssd, RecordCipher(lambda tenant, create: KEY))

    async def reopen_tier(self, tier: SealedTier, tmp_path: Path, capacity_bytes: int) -> SealedTier:
        await tier.close()
        t = await self.make_tier(tmp_path, capacity_bytes)
        await t.open()
        return t

    async def test_the_inner_tier_holds_sealed_records(self, tier: SealedTier) -> None:
        key = bytes(range(16))
        rec = make_record(key, 7)
        await tier.write(key, memoryview(rec))
        raw = bytearray(len(rec))
        assert await tier.inner.read_into(key, memoryview(raw)) == len(rec)
        assert is_sealed(np.frombuffer(raw, np.uint8)) and bytes(raw) != rec
        got = bytearray(len(rec))
        assert await tier.read_into(key, memoryview(got)) == len(rec) and bytes(got) == rec
