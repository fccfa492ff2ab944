"""TieredStore over an SSD tier with a GPU-direct path: records go engine -> device slab -> file
and back without host staging, are verified before they reach the engine, and everything falls
back to host staging when the path fails.

CPU stand-in: a CPU ``DeviceStagingPool`` and NIXL POSIX play device memory and GDS_MT.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dynamo_tiered_kv.blocks.codec import header_bytes
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.staging.device_slabs import DeviceStagingPool
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.ssd import SSDTier, metrics
from dynamo_tiered_kv.tiers.ssd.gds import DeviceIO

pytest.importorskip("nixl")
BS, LAYERS, HEADS, HEAD = 16, 2, 2, 64
NS = Namespace("gd", "bfloat16", "VLLM_CPU", BS, LAYERS, HEADS, HEAD)
N = 12


def layout(seed: int) -> EngineLayout:
    ts = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=LAYERS, num_blocks=N + 4, block_size=BS,
                            num_kv_heads=HEADS, head_size=HEAD)
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return EngineLayout(EngineLayoutKind.VLLM_CPU, ts, BS, HEADS, HEAD)


def block(lay: EngineLayout, b: int) -> bytes:
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in lay.tensors)


KEYS = chain_keys(NS, np.arange(N * BS) % 977)


def gd_bytes(op: str) -> float:
    return metrics.GPU_DIRECT_BYTES.labels(op)._value.get()


class Rig:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.pool = DeviceStagingPool(1 << 20, 2, "cpu")
        self.dio = DeviceIO("POSIX")
        self.dio.register(self.pool.slabs)
        self.staging = StagingPool(1 << 20, 2, pin=False)

    def store(self, host: bool = False) -> TieredStore:
        ssd = SSDTier(self.root, capacity_bytes=64 << 20, io="odirect", idle_seal_s=None, device_io=self.dio)
        tiers = [HostTier(8 << 20, pin=False), ssd] if host else [ssd]
        s = TieredStore(tiers, NS, self.staging, device_staging=self.pool, load_chunk_bytes=256 << 10)
        if ssd.io_path != "odirect":
            s.close()
            pytest.skip("this filesystem refuses O_DIRECT")
        return s

    def close(self) -> None:
        self.dio.close()
        self.pool.close()
        self.staging.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


def test_offload_and_load_go_through_device_slabs(rig: Rig) -> None:
    src, dst = layout(1), layout(2)
    w0, r0 = gd_bytes("write"), gd_bytes("read")
    with rig.store() as s:
        assert s.submit_offload(src, list(range(N)), KEYS, parents_of(KEYS))
        s.drain(10)
        assert gd_bytes("write") > w0
        targets = [N + 3 - i for i in range(N)]  # other engine blocks, reversed
        res = s.load(dst, targets, KEYS)
        assert res.loaded_block_ids == targets and not res.failed_block_ids
        assert gd_bytes("read") > r0
        assert all(block(src, i) == block(dst, t) for i, t in enumerate(targets))
    assert rig.staging.free_count == 2 and rig.pool.free_count == 2


def test_loads_from_ssd_skip_host_staging_and_promotion(rig: Rig) -> None:
    src, dst = layout(3), layout(4)
    with rig.store() as s:  # write through a store without host tier: GPU-direct
        s.submit_offload(src, list(range(N)), KEYS, parents_of(KEYS))
    with rig.store(host=True) as s:  # a restarted worker: empty host tier, SSD recovered
        assert s.lookup(KEYS).tier_per_block == ("ssd",) * N
        r0 = gd_bytes("read")
        res = s.load(dst, list(range(N)), KEYS)
        assert len(res.loaded_block_ids) == N and gd_bytes("read") > r0
        s.drain(10)
        assert not s.tiers[0].contains(KEYS[0]), "a GPU-direct load must not be promoted through host staging"
        assert all(block(src, i) == block(dst, i) for i in range(N))
        # with a host tier among the targets, offload takes host staging (one D2H copy feeds both)
        w0 = gd_bytes("write")
        more = chain_keys(NS, np.arange(N * BS) % 977 + 5000)
        assert s.submit_offload(src, list(range(N)), more, parents_of(more))
        s.drain(10)
        assert gd_bytes("write") == w0 and s.tiers[0].contains(more[0]) and s.tiers[1].contains(more[0])


def test_corrupt_record_read_direct_is_a_miss_and_never_reaches_the_engine(rig: Rig) -> None:
    src, dst = layout(5), layout(6)
    with rig.store() as s:
        s.submit_offload(src, list(range(N)), KEYS, parents_of(KEYS))
        s.persist(10)
    seg = next((rig.root / "rank-000").glob("seg-*.dtkv"))
    raw = bytearray(seg.read_bytes())
    offs = [i for i in range(0, len(raw) - 8, 4096) if raw[i:i + 8] == b"DTKVBLK\x00"]  # record starts
    assert len(offs) == N
    raw[offs[5] + header_bytes(LAYERS) + 100] ^= 0xFF
    seg.write_bytes(bytes(raw))
    before = block(dst, 5)
    with rig.store() as s:
        res = s.load(dst, list(range(N)), KEYS)
        assert res.loaded_block_ids == list(range(5)) and res.failed_block_ids == list(range(5, N))
        assert block(dst, 5) == before
        assert s.metrics.checksum_failures.labels("ssd")._value.get() == 1
        s.drain(10)
        assert not s.tiers[0].contains(KEYS[5]), "the corrupt record was not dropped"


def test_failing_gpu_direct_costs_one_recompute_then_host_staging_serves(rig: Rig,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    src = layout(7)
    with rig.store() as s:
        s.submit_offload(src, list(range(N)), KEYS, parents_of(KEYS))
    with rig.store() as s:

        def broken(*a, **kw):
            raise OSError(5, "cuFile registration failed (5030)")

        monkeypatch.setattr(rig.dio, "read", broken)
        dst = layout(8)
        first = s.load(dst, list(range(N)), KEYS)
        assert first.failed_block_ids == list(range(N))  # recompute, no hang, no stale bytes
        assert s.tiers[0].device_io is None
        second = s.load(dst, list(range(N)), KEYS)
        assert second.loaded_block_ids == list(range(N))
        assert all(block(src, i) == block(dst, i) for i in range(N))
        # and offloads fall back to host staging too
        more = chain_keys(NS, np.arange(N * BS) % 977 + 7000)
        assert s.submit_offload(src, list(range(N)), more, parents_of(more))
        s.drain(10)
        assert s.tiers[0].contains(more[-1])
