"""build_store wires config to real tiers: host + SSD + local-directory objects with a flusher."""

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store

pytestmark = pytest.mark.usefixtures("no_dtkv_env")


def _layout(seed: int) -> EngineLayout:
    ts = allocate_engine_kv(
        EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, head_size=64
    )
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        t.copy_(torch.randn(t.shape, generator=g))
    return EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 16, 2, 64)


NS = Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)


def _config(tmp_path: Path, **kw) -> TieredKVConfig:
    base = {
        "host_capacity_bytes": 8 << 20,
        "ssd_dir": str(tmp_path / "ssd"),
        "ssd_capacity_bytes": 64 << 20,
        "ssd_segment_bytes": 1 << 20,
        "ssd_seal_idle_s": 0.2,
        "object_url": f"file://{tmp_path / 'objects'}",
        "object_refresh_s": None,
        "staging_slab_bytes": 1 << 20,
        "staging_slabs": 2,
    }
    base.update(kw)
    return TieredKVConfig.from_mapping(base)


def test_offload_flush_and_restore_from_objects_only(tmp_path: Path) -> None:
    src = _layout(1)
    keys = chain_keys(NS, np.arange(16 * 6))
    cfg = _config(tmp_path)
    store = build_store(cfg, NS)
    try:
        assert [t.name for t in store.tiers] == ["host", "ssd", "object"]
        assert store.submit_offload(src, list(range(6)), keys, parents_of(keys))
        assert store.drain(30)
        ssd = store.tiers[1]
        store._call(_seal(ssd), timeout=30)
        assert store._call(store.flusher.drain(30), timeout=40)
        assert store.flusher.stats.flushed_segments >= 1
        body = _scrape(store)
        assert "dtkv_flush_segments_total" in body
        assert "dtkv_ssd_written_bytes_total" in body  # the SSD tier's process-wide metrics too
    finally:
        store.close()
    # a fresh store with an empty host tier and a wiped SSD directory restores from objects
    import shutil

    shutil.rmtree(tmp_path / "ssd")
    store2 = build_store(_config(tmp_path), NS)
    try:
        objects = store2.tiers[-1]
        deadline = time.monotonic() + 60
        while not objects.index_ready and time.monotonic() < deadline:  # indexed in the background
            time.sleep(0.05)
        look = store2.lookup(keys)
        assert look.num_blocks == 6 and set(look.tier_per_block) == {"object"}
        dst = _layout(2)
        res = store2.load(dst, list(range(10, 16)), keys, timeout=30)
        assert list(res.failed_block_ids) == []
        for j in range(2):
            assert np.array_equal(dst.layer_views[j][10:16], src.layer_views[j][0:6])
    finally:
        store2.close()


async def _seal(ssd) -> None:
    await ssd.seal()


def _scrape(store) -> str:
    from prometheus_client import generate_latest

    return generate_latest(store.metrics.registry).decode()


def test_no_tier_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tier"):
        build_store(TieredKVConfig.from_mapping({"host_capacity_bytes": 0}), NS)


def test_gpu_direct_needs_cuda_and_a_passing_gds_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv import factory
    from dynamo_tiered_kv.tiers.ssd import gds_probe as ssd_io

    cfg = _config(tmp_path, host_capacity_bytes=0)
    if not torch.cuda.is_available():
        assert factory._gpu_direct(cfg) is None
        store = build_store(cfg, NS)
        try:
            assert store.device_staging is None and store.tiers[0].device_io is None
        finally:
            store.close()
    probed: list[bool] = []

    def verdict(directory: object = None, slab_bytes: int = 0) -> ssd_io.GdsVerdict:
        probed.append(True)
        return ssd_io.GdsVerdict(False, "nvidia-fs not loaded")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ssd_io, "gds_verdict", verdict)
    assert factory._gpu_direct(cfg) is None and probed == [True]
    assert factory._gpu_direct(_config(tmp_path, ssd_gpu_direct="off")) is None and probed == [True]


@pytest.mark.gpu
def test_gpu_direct_round_trip_through_build_store(tmp_path: Path) -> None:
    from dynamo_tiered_kv.tiers.ssd import metrics
    from dynamo_tiered_kv.tiers.ssd.gds_probe import gds_verdict

    if not gds_verdict().available:
        pytest.skip(f"GPUDirect Storage not usable here: {gds_verdict().reason}")
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2,
                            head_size=64, device="cuda")
    for t in ts:
        t.normal_()
    src = EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 16, 2, 64)
    dst = EngineLayout(EngineLayoutKind.FLASH_ATTN, [torch.zeros_like(t) for t in ts], 16, 2, 64)
    keys = chain_keys(NS, np.arange(16 * 6))
    store = build_store(_config(tmp_path, host_capacity_bytes=0, object_url=None), NS)
    try:
        assert store.device_staging is not None and store.tiers[0].device_io is not None
        w0 = metrics.GPU_DIRECT_BYTES.labels("write")._value.get()
        assert store.submit_offload(src, list(range(6)), keys, parents_of(keys))
        store.drain(30)
        assert metrics.GPU_DIRECT_BYTES.labels("write")._value.get() > w0
        res = store.load(dst, list(range(6)), keys)
        assert res.loaded_block_ids == list(range(6))
        for a, b in zip(src.tensors, dst.tensors):
            assert torch.equal(a[:, :6], b[:, :6])
    finally:
        store.close()


def test_observability_failures_never_fail_build_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy metrics port (a restarted worker's predecessor still holds it) and a collector that
    cannot be registered cost metrics only: the store is built and serves."""
    import socket

    from prometheus_client import CollectorRegistry

    from dynamo_tiered_kv import factory

    held = socket.socket()
    held.bind(("0.0.0.0", 0))
    held.listen(1)
    port = held.getsockname()[1]
    real_register = CollectorRegistry.register

    def register(self, collector) -> None:
        if isinstance(collector, factory._FlushCollector):
            raise ValueError("Duplicated timeseries in CollectorRegistry")
        real_register(self, collector)

    monkeypatch.setattr(CollectorRegistry, "register", register)
    src = _layout(3)
    keys = chain_keys(NS, np.arange(16 * 2))
    try:
        store = build_store(_config(tmp_path, metrics_port=port), NS, rank=0)
        try:
            assert store.metrics_port not in (None, port)
            assert store.metrics.value("observability_failures_total", what="port") == 1
            assert store.metrics.value("observability_failures_total", what="collector") == 1
            assert store.submit_offload(src, [0, 1], keys, parents_of(keys)) and store.drain(30)
            assert store.lookup(keys).num_blocks == 2
        finally:
            store.close()
    finally:
        held.close()


def test_worker_rank_is_one_formula_for_every_adapter() -> None:
    """Data outermost, then pipeline, then tensor: unique per worker of a host for every shape."""
    from dynamo_tiered_kv.connectors.sglang.identity import Ranks
    from dynamo_tiered_kv.factory import worker_rank

    seen = set()
    for dp in range(2):
        for pp in range(3):
            for tp in range(4):
                r = worker_rank(tp_rank=tp, tp_size=4, pp_rank=pp, pp_size=3, dp_rank=dp)
                assert Ranks(tp_rank=tp, tp_size=4, pp_rank=pp, pp_size=3, dp_rank=dp).process_rank == r
                seen.add(r)
    assert seen == set(range(24))
