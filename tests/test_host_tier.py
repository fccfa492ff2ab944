from pathlib import Path

from dynamo_tiered_kv.testing import TierConformanceTests
from dynamo_tiered_kv.tiers.host import HostTier


class TestHostTier(TierConformanceTests):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> HostTier:
        return HostTier(capacity_bytes, chunk_bytes=64 * 1024, pin=False)
