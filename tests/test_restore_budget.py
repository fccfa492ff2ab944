"""A restore from the object tier never costs more than recomputing it (``recompute_tokens_per_s``):
through ``build_store`` and ``TieredStore.load``, against moto (Ceph RGW when marked s3) behind a
real TCP proxy that stalls or slows the bucket.

* a stalled bucket: the load gives up (a miss, recomputed) at its budget, not at its 30 s timeout;
* GETs known to be slower than the budget: a miss at once, without a GET;
* both counted in ``dtkv_restores_abandoned_total{reason}``.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, proxied_store_settings

from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.store.reads.budget import BUDGET_FLOOR_S
from dynamo_tiered_kv.tiers.objectstore import S3Backend
from dynamo_tiered_kv.tiers.objectstore.latency import MIN_SAMPLES

pytest_plugins = ["infra.fixtures_s3"]
pytestmark = pytest.mark.usefixtures("no_dtkv_env")
NS = Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 2, 2, 32)
BLOCKS = 8
TIMEOUT_S = 30.0  # the load's own deadline: what a stalled bucket cost before the budget
MARGIN_S = 3.0  # a loaded 2-core box



def _layout() -> EngineLayout:
    tensors = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=2, num_blocks=2 * BLOCKS + 1, block_size=16,
                                 num_kv_heads=2, head_size=32)
    for t in tensors:
        t.copy_(t.new_tensor(np.random.default_rng(3).standard_normal(tuple(t.shape))))
    return EngineLayout(EngineLayoutKind.VLLM_CPU, tensors, 16, 2, 32)


async def _stored(server: S3Server, proxy: FaultProxy, tokens_per_s: float) -> tuple[TieredStore, EngineLayout, list]:
    """A store whose only tier is the bucket behind ``proxy``, holding one prefix of BLOCKS blocks."""
    cfg = TieredKVConfig.from_mapping(await proxied_store_settings(server, proxy.endpoint, "budget",
                                                                   recompute_tokens_per_s=tokens_per_s))
    store = await asyncio.to_thread(build_store, cfg, NS)  # its loop talks to the proxy on ours
    (tier,) = store.tiers
    assert await asyncio.to_thread(store._call, tier.wait_ready(30), 40)
    layout = _layout()
    keys = chain_keys(NS, np.arange(BLOCKS * 16))
    assert store.submit_offload(layout, list(range(1, BLOCKS + 1)), keys, parents_of(keys))
    assert await asyncio.to_thread(store.drain, 30)
    res = await asyncio.to_thread(store.load, layout, list(range(BLOCKS + 1, 2 * BLOCKS + 1)), keys, TIMEOUT_S)
    assert res.failed_block_ids == []  # served while the bucket answers
    return store, layout, keys


async def _load(store: TieredStore, layout: EngineLayout, keys: list) -> tuple[list[int], float]:
    t0 = time.monotonic()
    res = await asyncio.to_thread(store.load, layout, list(range(BLOCKS + 1, 2 * BLOCKS + 1)), keys, TIMEOUT_S)
    return res.failed_block_ids, time.monotonic() - t0


async def test_a_stalled_bucket_costs_a_restore_its_budget_not_its_timeout(server: S3Server,
                                                                          proxy: FaultProxy) -> None:
    budget_s = 1.5
    store, layout, keys = await _stored(server, proxy, tokens_per_s=BLOCKS * 16 / budget_s)
    try:
        proxy.set_mode("stall")  # requests accepted, never answered
        proxy.sever()
        failed, took = await _load(store, layout, keys)
        assert failed == list(range(BLOCKS + 1, 2 * BLOCKS + 1))  # a miss: the engine recomputes
        assert took < budget_s + MARGIN_S, f"the restore took {took:.1f} s; recomputing takes {budget_s} s"
        m = store.metrics
        assert m.value("restores_abandoned_total", reason="budget") == 1
        assert m.value("restores_abandoned_total", reason="deadline") == 0
        proxy.set_mode("pass")
        failed, _ = await _load(store, layout, keys)
        assert failed == []  # and the next restore is served
    finally:
        proxy.set_mode("pass")
        await asyncio.to_thread(store.close)


async def test_gets_slower_than_the_budget_are_a_miss_at_once_without_a_get(server: S3Server,
                                                                            proxy: FaultProxy) -> None:
    store, layout, keys = await _stored(server, proxy, tokens_per_s=1e9)  # the budget: its floor
    try:
        (tier,) = store.tiers
        backend = tier.root_backend
        assert isinstance(backend, S3Backend)
        data = tier.location(keys[0])[0]
        proxy.delay_s = 0.6  # the gateway now answers every GET in 0.6 s, three times the budget
        proxy.set_mode("delay")
        proxy.sever()

        async def slow_gets() -> None:
            await asyncio.gather(*(tier.backend.get_range(data, 0, [memoryview(bytearray(100))])
                                   for _ in range(MIN_SAMPLES)))

        await asyncio.to_thread(store._call, slow_gets(), 30)
        expected = backend.expected_get_s(BLOCKS * 8192)
        assert expected is not None and expected > BUDGET_FLOOR_S
        gets, connections = backend.stats.gets, proxy.connections
        failed, took = await _load(store, layout, keys)
        assert failed == list(range(BLOCKS + 1, 2 * BLOCKS + 1))
        assert backend.stats.gets == gets and proxy.connections == connections  # nothing was sent
        assert took < BUDGET_FLOOR_S + MARGIN_S
        m = store.metrics
        assert m.value("restores_abandoned_total", reason="estimate") == 1
        assert m.value("restores_abandoned_total", reason="budget") == 0
    finally:
        proxy.set_mode("pass")
        await asyncio.to_thread(store.close)
