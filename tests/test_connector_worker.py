"""vLLM connector worker role and construction checks, without an engine."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.metadata import LoadSpec, TieredKVMetadata
from dynamo_tiered_kv.errors import ConfigError

BS = 4


class _SlowStore:
    """Answers every load after ``delay`` seconds, like ``TieredStore.load``: a load not done
    within its ``timeout`` returns with its blocks failed."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.timeouts: list[float] = []

    def load(self, layout, ids, keys, timeout=None, pacer=None, decode_threads=None):
        from dynamo_tiered_kv.store.store import LoadResult

        self.timeouts.append(timeout)
        if timeout is not None and timeout < self.delay:
            time.sleep(timeout)
            return LoadResult([], list(ids), [])
        time.sleep(self.delay)
        return LoadResult(list(ids), [], ["ssd"] * len(ids))


def _worker(store, **cfg):
    from dynamo_tiered_kv.blocks.keys import Namespace
    from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole

    w = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bf16", block_size=BS, num_kv_heads=1,
                   head_size=1, tp_rank=0, tp_size=1, engine_key="x", authkey=b"x")
    w.store, w.layout = store, object()
    w.namespace = Namespace("m", "bf16", "FLASH_ATTN", BS, 1, 1, 1)
    return w


def test_one_load_deadline_per_step_and_late_blocks_are_recomputed() -> None:
    timeout = 0.5
    store = _SlowStore(delay=0.3)
    w = _worker(store, load_timeout_s=timeout)
    loads = [LoadSpec(f"r{i}", [10 * i, 10 * i + 1], [bytes([i]) * 16, bytes([i + 100]) * 16]) for i in range(4)]
    t0 = time.monotonic()
    w.start_load_kv(TieredKVMetadata(loads=loads))
    elapsed = time.monotonic() - t0
    assert elapsed < timeout + 0.4, f"4 slow loads took {elapsed:.2f}s, more than one {timeout}s deadline"
    # The first load answered in time, the second ran into the deadline, the rest never waited.
    assert w.served["r0"] == ["ssd", "ssd"]
    assert w.get_block_ids_with_load_errors() == {10, 11, 20, 21, 30, 31}
    assert len(store.timeouts) == 2 and store.timeouts[1] < timeout - 0.25


def _vllm_config(dcp: int, pcp: int):
    ktc = SimpleNamespace(kv_connector_extra_config={}, engine_id="e", kv_load_failure_policy="recompute")
    pc = SimpleNamespace(decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
                         tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0)
    return SimpleNamespace(kv_transfer_config=ktc, parallel_config=pc)


@pytest.mark.parametrize(("dcp", "pcp"), [(2, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_context_parallelism_is_refused_at_construction(dcp: int, pcp: int, role: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from dynamo_tiered_kv.connectors.vllm.connector import TieredKVConnector

    with pytest.raises(ConfigError, match=r"context parallelism.*decode_context_parallel_size"):
        TieredKVConnector(_vllm_config(dcp, pcp), KVConnectorRole[role])
