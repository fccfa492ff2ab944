"""The SSD tier against the shared conformance suite, on every I/O path."""

from __future__ import annotations

from pathlib import Path

from dynamo_tiered_kv.testing import TierConformanceTests
from dynamo_tiered_kv.tiers.ssd import SSDTier


class TestSSDTier(TierConformanceTests):
    """Standalone tier (no flusher attached), so sealed segments are evictable by default."""

    io = "auto"

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> SSDTier:
        return SSDTier(tmp_path, capacity_bytes=capacity_bytes, segment_bytes=256 << 10, io=self.io,
                       idle_seal_s=None)

    async def reopen_tier(self, tier: SSDTier, tmp_path: Path, capacity_bytes: int) -> SSDTier:
        await tier.close()
        t = await self.make_tier(tmp_path, capacity_bytes)
        await t.open()
        return t

    async def test_uses_requested_io_path(self, tier: SSDTier) -> None:
        assert tier.available
        expected = {"auto": ("nixl", "odirect"), "odirect": ("odirect",)}[self.io]
        assert tier.io_path in expected


class TestSSDTierODirect(TestSSDTier):
    io = "odirect"


class TestSSDTierBuffered(TestSSDTier):
    io = "buffered"

    async def test_uses_requested_io_path(self, tier: SSDTier) -> None:
        assert tier.io_path == "buffered"
