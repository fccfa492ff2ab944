"""GPU-only checks of the SSD tier: pinned staging slabs through O_DIRECT, and the GDS probe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.ssd import SSDTier, metrics

pytestmark = pytest.mark.gpu


async def test_pinned_staging_round_trip_through_the_tier(tmp_path: Path) -> None:
    pool = StagingPool(1 << 20, 2, pin=True)
    t = SSDTier(tmp_path, capacity_bytes=64 << 20, idle_seal_s=None)
    await t.open()
    try:
        assert pool.pinned and t.available
        shape = small_shape(num_layers=4)
        items = [(random_key(i, b"gpu"), make_record(random_key(i, b"gpu"), i, shape=shape)) for i in range(8)]
        n = len(items[0][1])
        src, dst = pool.acquire(), pool.acquire()
        gpu = torch.empty(n * len(items), dtype=torch.uint8, device="cuda")
        gpu.copy_(torch.frombuffer(bytearray(b"".join(v for _, v in items)), dtype=torch.uint8))
        src.tensor[:gpu.numel()].copy_(gpu, non_blocking=True)  # device -> pinned slab (the bounce path)
        torch.cuda.synchronize()
        await t.write_many((k, src.view[j * n:(j + 1) * n]) for j, (k, _) in enumerate(items))
        got = await t.read_many([ReadRequest(k, dst.view[j * n:(j + 1) * n]) for j, (k, _) in enumerate(items)])
        assert got == [n] * len(items)
        back = dst.tensor[:gpu.numel()].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, gpu)
    finally:
        await t.close()
        pool.close()


async def test_gds_probe_verdict_is_reported(tmp_path: Path) -> None:
    t = SSDTier(tmp_path, capacity_bytes=1 << 20, idle_seal_s=None)
    await t.open()
    try:
        assert t.gds.reason and t.gds.reason != "not probed"
        assert metrics.GDS_AVAILABLE._value.get() == (1 if t.gds.available else 0)
        print(f"GDS verdict: {t.gds}")
    finally:
        await t.close()
