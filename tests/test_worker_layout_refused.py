"""A KV layout the codec refuses disables the connector on that worker; the worker keeps serving."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.metadata import LoadSpec, SaveSpec, TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole

BS = 4


def _worker() -> WorkerRole:
    cfg = TieredKVConfig.from_mapping({"metrics_port": None, "host_capacity_bytes": 16 << 20})
    return WorkerRole(cfg, model_id="m", kv_dtype="float64", block_size=BS, num_kv_heads=2, head_size=8,
                      tp_rank=0, tp_size=1, engine_key=f"t-{uuid.uuid4().hex[:8]}", authkey=b"k")


def test_refused_cpu_layout_disables_the_connector(caplog: pytest.LogCaptureFixture) -> None:
    # float64 KV: a real CPU vLLM-shaped cache whose dtype the record format cannot describe
    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=8, block_size=BS,
                                num_kv_heads=2, head_size=8, dtype=torch.float64)
    before = [t.clone() for t in caches]
    w = _worker()
    try:
        with caplog.at_level(logging.ERROR, logger="dynamo_tiered_kv.connectors.vllm.worker"):
            w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
        assert w.store is None and w.layout is None
        assert any(r.levelno == logging.ERROR and "disabled on this worker" in r.getMessage() for r in caplog.records)

        hashes = [bytes([i]) * 16 for i in range(3)]
        assert w.lookup(hashes) == (0, ())  # nothing restorable
        w.wait_for_save(TieredKVMetadata(saves=[SaveSpec("a", [1, 2, 3], hashes, 0)]))  # skipped
        w.start_load_kv(TieredKVMetadata(loads=[LoadSpec("s", [4, 5], hashes[:2]),
                                                LoadSpec("b", [6, 7], hashes[:2], is_async=True)]))
        assert w.get_finished(set()) == {"b"}
        assert w.get_block_ids_with_load_errors() == {4, 5, 6, 7}  # failed-safe: vLLM recomputes them
        assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))  # engine memory untouched
        w.unregister_kv_caches()  # sleep and wake-up work on a disabled worker too
        w.restore_kv_caches()
    finally:
        w.shutdown()
