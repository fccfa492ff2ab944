"""A restore from a misbehaving bucket gives up in bounded time with the store's default settings
(no ``recompute_tokens_per_s``): through ``build_store`` and ``TieredStore.load``, against moto
(Ceph RGW when marked s3) behind a real TCP proxy, on both read paths (the direct reader and
aiobotocore).

* every request delayed 10 s (a stalled gateway): every block a miss within the read's
  first-byte allowance (``STALL_WAITS`` first-byte bounds, 2 s), well inside the 3 s goal, where
  four full first-byte waits (4.2 s) were spent before; hedges on (the latency window is warm);
* every response reset mid-body: the retries run (a reset is not a stall) and the restore
  returns within the retry policy's backoffs, serving no wrong byte;
* every response cut mid-body and then silent (a reset that never arrives): two body idle
  timeouts, not one per attempt (four: over 8 s);
* after each fault, once the bucket answers again, every block restores (nothing was lost).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, proxied_store_settings, unique_bucket

from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.tiers.objectstore import S3Backend
from dynamo_tiered_kv.tiers.objectstore.latency import MIN_SAMPLES
from dynamo_tiered_kv.tiers.objectstore.stalls import STALL_WAITS

pytest_plugins = ["infra.fixtures_s3"]
pytestmark = pytest.mark.usefixtures("no_dtkv_env")
NS = Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 2, 2, 32)
BLOCKS = 8
SRC = list(range(1, BLOCKS + 1))
DST = list(range(BLOCKS + 1, 2 * BLOCKS + 1))
TIMEOUT_S = 30.0  # the store's default load_timeout_s
GOAL_S = 3.0  # a restore from a stalled bucket gives up within this
MARGIN_S = 1.5  # a loaded 2-core box
PATHS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "aiobotocore"])


def _layout() -> EngineLayout:
    tensors = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=2, num_blocks=2 * BLOCKS + 1, block_size=16,
                                 num_kv_heads=2, head_size=32)
    for t in tensors:
        t.copy_(t.new_tensor(np.random.default_rng(5).standard_normal(tuple(t.shape))))
    return EngineLayout(EngineLayoutKind.VLLM_CPU, tensors, 16, 2, 32)


async def _stored(server: S3Server, proxy: FaultProxy, direct: bool) -> tuple[TieredStore, EngineLayout, list]:
    """A store with default settings whose only tier is the bucket behind ``proxy``, holding one
    prefix, restored MIN_SAMPLES times while the bucket answers (a warm latency window: hedges on)."""
    cfg = TieredKVConfig.from_mapping(await proxied_store_settings(server, proxy.endpoint, "stall",
                                                                   s3_direct_reads=direct))
    store = await asyncio.to_thread(build_store, cfg, NS)  # its loop talks to the proxy on ours
    (tier,) = store.tiers
    assert await asyncio.to_thread(store._call, tier.wait_ready(30), 40)
    layout = _layout()
    keys = chain_keys(NS, np.arange(BLOCKS * 16))
    assert store.submit_offload(layout, SRC, keys, parents_of(keys))
    assert await asyncio.to_thread(store.drain, 30)
    for _ in range(MIN_SAMPLES):
        failed, _took = await _load(store, layout, keys)
        assert failed == []  # served while the bucket answers
    assert _backend(store).hedger.delay() is not None  # a late GET would be hedged
    return store, layout, keys


def _backend(store: TieredStore) -> S3Backend:
    backend = store.tiers[0].root_backend  # type: ignore[attr-defined]
    assert isinstance(backend, S3Backend)
    return backend


async def _load(store: TieredStore, layout: EngineLayout, keys: list) -> tuple[list[int], float]:
    for t in layout.tensors:
        t[DST] = 0  # nothing of an earlier restore can pass for this one's
    t0 = time.monotonic()
    res = await asyncio.to_thread(store.load, layout, DST, keys, TIMEOUT_S)
    return res.failed_block_ids, time.monotonic() - t0


def _wrong(layout: EngineLayout, failed: list[int]) -> list[int]:
    """Restored blocks whose bytes differ from the stored ones."""
    return [d for s, d in zip(SRC, DST) if d not in failed
            and any(not bool((t[d] == t[s]).all()) for t in layout.tensors)]


@PATHS
async def test_a_bucket_that_delays_every_request_10s_is_a_miss_within_3s(
        server: S3Server, proxy: FaultProxy, direct: bool) -> None:
    store, layout, keys = await _stored(server, proxy, direct)
    backend = _backend(store)
    try:
        faults = proxy.faults
        proxy.delay_s = 10.0
        proxy.set_mode("delay")  # every response held 10 s: no first byte within any bound
        proxy.sever()
        failed, took = await _load(store, layout, keys)
        assert failed == DST  # a miss: the engine recomputes the prefix
        assert took < GOAL_S + MARGIN_S, f"the restore gave up after {took:.2f} s (goal {GOAL_S} s)"
        # the GET, its hedge and one retry with what is left of the read's first-byte allowance,
        # not three more full waits
        assert proxy.faults - faults <= STALL_WAITS + 1, proxy.faults - faults
        # counted once, for the stall, though no restore budget is set
        assert store.metrics.value("restores_abandoned_total", reason="stall") == 1
        proxy.set_mode("pass")
        proxy.sever()
        await asyncio.sleep(backend.breaker.cooldown_s if backend.breaker.state != "closed" else 0)
        failed, _ = await _load(store, layout, keys)
        assert failed == [] and _wrong(layout, failed) == []  # and the next restore is served
    finally:
        proxy.set_mode("pass")
        await asyncio.to_thread(store.close)


@PATHS
async def test_resets_mid_body_end_within_the_retry_bound_and_serve_no_wrong_byte(
        server: S3Server, proxy: FaultProxy, direct: bool) -> None:
    store, layout, keys = await _stored(server, proxy, direct)
    backend = _backend(store)
    try:
        r = backend.retry
        bound = sum(min(r.max_delay_s, r.base_delay_s * 2 ** n) for n in range(r.max_attempts - 1))
        retries = backend.stats.retries
        proxy.body_after = 4096  # each response cut 4 KiB into its body, every connection
        proxy.set_mode("reset_body")
        proxy.sever()
        failed, took = await _load(store, layout, keys)
        assert failed == DST
        assert _wrong(layout, failed) == []
        assert backend.stats.retries - retries == r.max_attempts - 1  # a reset is retried: it is no stall
        assert took < bound + MARGIN_S, f"the restore gave up after {took:.2f} s (retry bound {bound:.2f} s)"
        proxy.set_mode("pass")
        proxy.sever()
        await asyncio.sleep(backend.breaker.cooldown_s if backend.breaker.state != "closed" else 0)
        failed, _ = await _load(store, layout, keys)
        assert failed == [] and _wrong(layout, failed) == []  # nothing was lost
    finally:
        proxy.set_mode("pass")
        await asyncio.to_thread(store.close)


@PATHS
async def test_a_reset_that_never_arrives_costs_two_idle_timeouts_not_four(
        server: S3Server, proxy: FaultProxy, direct: bool) -> None:
    """Every response cut 4 KiB into its body and then silent (the reset never reaches us): the
    second attempt that ends in silence ends the read."""
    store, layout, keys = await _stored(server, proxy, direct)
    backend = _backend(store)
    try:
        bound = STALL_WAITS * backend.body_idle_timeout_s + backend.retry.base_delay_s
        retries = backend.stats.retries
        proxy.body_after = 4096
        proxy.set_mode("stall_body")
        proxy.sever()
        failed, took = await _load(store, layout, keys)
        assert failed == DST
        assert _wrong(layout, failed) == []
        # one retry (aiobotocore: maybe one more, for a pooled connection the proxy had cut)
        assert backend.stats.retries - retries <= STALL_WAITS, backend.stats.retries - retries
        assert took < bound + MARGIN_S, f"the restore gave up after {took:.2f} s (bound {bound:.2f} s)"
        proxy.set_mode("pass")
        proxy.sever()
        await asyncio.sleep(backend.breaker.cooldown_s if backend.breaker.state != "closed" else 0)
        failed, _ = await _load(store, layout, keys)
        assert failed == [] and _wrong(layout, failed) == []  # nothing was lost
    finally:
        proxy.set_mode("pass")
        await asyncio.to_thread(store.close)


@PATHS
async def test_a_stall_of_one_get_and_its_hedge_is_retried_and_served(
        server: S3Server, proxy: FaultProxy, direct: bool) -> None:
    """Not a stalled gateway but two lost requests (the GET and its hedge): the retry gets what
    is left of the read's allowance, which is enough, and the read is served."""
    backend = S3Backend(unique_bucket("stall1"), "s/", **{**server.backend_kwargs(), "endpoint_url": proxy.endpoint},
                        direct_reads=direct)  # type: ignore[arg-type]
    await backend.open()
    try:
        data = bytes(range(251)) * 400
        await backend.put_object("o", data)
        for _ in range(MIN_SAMPLES):  # a warm window: a late GET is hedged
            assert await backend.get_range("o", 0, [memoryview(bytearray(len(data)))]) == len(data)
        proxy.set_mode("stall", count=2)  # the next two connections never answer, then all do
        proxy.sever()
        buf = bytearray(len(data))
        t0 = time.monotonic()
        assert await asyncio.wait_for(backend.get_range("o", 0, [memoryview(buf)]), 20) == len(data)
        assert bytes(buf) == data
        assert backend.stats.hedges_sent == 1 and backend.stats.retries == 1
        assert time.monotonic() - t0 >= backend.first_byte_timeout_s  # it did wait out the stall
    finally:
        await backend.close()
