"""``TieredStore.load_into`` from the object tier: records of one run in one data object arrive
with one ranged GET, its body received straight into the caller's buffers (no staging slab, no
scatter copy) and verified there; through ``build_store``, against moto (Ceph RGW when marked
s3) behind a real TCP proxy.

* a corrupt record fails its block and every later one, and is not served again;
* a stalled bucket: the call returns at its deadline, its GET cancelled (nothing is written into
  the buffers after it returned), without waiting for the read;
* GETs known to be slower than recomputing: a miss at once, without a GET.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, count_slab_takes, proxied_store_settings

from dynamo_tiered_kv.blocks.codec import header_bytes, record_bytes
from dynamo_tiered_kv.blocks.keys import BlockKey, Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.store.reads.into_buffers import LoopRead
from dynamo_tiered_kv.tiers.objectstore import ObjectTier
from dynamo_tiered_kv.tiers.objectstore.latency import MIN_SAMPLES

pytest_plugins = ["infra.fixtures_s3"]
pytestmark = pytest.mark.usefixtures("no_dtkv_env")
N = 12
ROW = 10240  # 512-aligned, not a page multiple: each record is header + row + padding
NS = Namespace("into-object", "bfloat16", "VLLM_CPU", 1, 1, 1, ROW // 2)
MARGIN_S = 3.0  # a loaded 2-core box


@dataclass
class Rig:
    store: TieredStore
    tier: ObjectTier
    rows: np.ndarray  # (N, ROW): the caller's blocks, one contiguous row each
    layout: EngineLayout
    keys: list[BlockKey]
    saved: np.ndarray

    def load_into(self, timeout: float) -> object:
        return self.store.load_into(self.layout.shape, list(self.rows), self.keys, timeout=timeout)


async def _rig(server: S3Server, proxy: FaultProxy, tokens_per_s: float | None = None) -> Rig:
    """A store whose only tier is the bucket behind ``proxy``, holding N one-token blocks."""
    cfg = TieredKVConfig.from_mapping(await proxied_store_settings(server, proxy.endpoint, "into",
                                                                   recompute_tokens_per_s=tokens_per_s))
    store = await asyncio.to_thread(build_store, cfg, NS)
    (tier,) = store.tiers
    assert isinstance(tier, ObjectTier) and tier.split_reads
    assert await asyncio.to_thread(store._call, tier.wait_ready(30), 40)
    rows = np.random.default_rng(7).integers(0, 256, (N, ROW), dtype=np.uint8)
    layout = EngineLayout(EngineLayoutKind.VLLM_CPU, [torch.from_numpy(rows).reshape(N, 1, 1, ROW)], block_size=1,
                          num_kv_heads=1, head_size=ROW // 2)
    keys = chain_keys(NS, list(range(N)))
    assert store.submit_offload(layout, list(range(N)), keys, parents_of(keys))
    assert await asyncio.to_thread(store.drain, 30)
    saved = rows.copy()
    rows[:] = 0
    return Rig(store, tier, rows, layout, keys, saved)


async def test_a_run_of_records_is_one_get_straight_into_the_callers_buffers(server: S3Server,
                                                                             proxy: FaultProxy) -> None:
    rig = await _rig(server, proxy)
    try:
        taken = count_slab_takes(rig.store.staging)
        gets = rig.tier.root_backend.stats.gets
        res = await asyncio.to_thread(rig.load_into, 30)
        assert (res.restored, res.planned) == (N, N)
        assert res.tier_per_block == ["object"] * N
        assert np.array_equal(rig.rows, rig.saved)
        assert taken[0] == 0  # no staging slab: no scatter copy on the way into the buffers
        assert rig.tier.root_backend.stats.gets == gets + 1  # one object, one run: one ranged GET
        assert rig.store.metrics.value("tier_hits", tier="object") == N
    finally:
        await asyncio.to_thread(rig.store.close)


async def test_a_corrupt_record_fails_its_block_and_every_later_one(server: S3Server, proxy: FaultProxy) -> None:
    rig = await _rig(server, proxy)
    try:
        data, entry = rig.tier.location(rig.keys[5])
        backend = rig.tier.backend
        body = bytearray(await asyncio.to_thread(rig.store._call, backend.get_bytes(data), 30))
        body[entry.offset + header_bytes(1) + 777] ^= 0x10  # one payload byte of block 5
        await asyncio.to_thread(rig.store._call, backend.put_object(data, bytes(body)), 30)
        res = await asyncio.to_thread(rig.load_into, 30)
        assert (res.restored, res.planned) == (5, N)
        assert np.array_equal(rig.rows[:5], rig.saved[:5])
        assert rig.store.metrics.value("checksum_failures", tier="object") == 1
        assert rig.store.lookup(rig.keys).num_blocks == 5  # never served again from here
    finally:
        await asyncio.to_thread(rig.store.close)


async def test_a_stalled_bucket_returns_at_the_deadline_with_its_get_cancelled(server: S3Server,
                                                                                proxy: FaultProxy) -> None:
    rig = await _rig(server, proxy)
    try:
        proxy.set_mode("stall")  # requests accepted, never answered
        proxy.sever()
        rig.rows[:] = 0xAB
        t0 = time.monotonic()
        res = await asyncio.to_thread(rig.load_into, 0.5)
        took = time.monotonic() - t0
        assert (res.restored, res.planned) == (0, N)
        assert not res.waited_past_deadline  # the GET was cancelled, not waited for
        assert took < 0.5 + MARGIN_S
        assert rig.store.metrics.value("restores_abandoned", reason="deadline") == 1
        proxy.set_mode("pass")  # were the GET still running, its body would land now
        await asyncio.sleep(1.0)
        assert (rig.rows == 0xAB).all()
        res = await asyncio.to_thread(rig.load_into, 30)
        assert res.restored == N and np.array_equal(rig.rows, rig.saved)  # and the next load is served
    finally:
        proxy.set_mode("pass")
        await asyncio.to_thread(rig.store.close)


async def test_gets_slower_than_recomputing_are_a_miss_at_once_without_a_get(server: S3Server,
                                                                            proxy: FaultProxy) -> None:
    rig = await _rig(server, proxy, tokens_per_s=1e9)  # the budget: its floor
    try:
        tier, backend = rig.tier, rig.tier.root_backend
        data = tier.location(rig.keys[0])[0]
        proxy.delay_s = 0.6  # every GET now takes 0.6 s, three times the budget
        proxy.set_mode("delay")
        proxy.sever()

        async def slow_gets() -> None:
            await asyncio.gather(*(tier.backend.get_range(data, 0, [memoryview(bytearray(100))])
                                   for _ in range(MIN_SAMPLES)))

        await asyncio.to_thread(rig.store._call, slow_gets(), 30)
        assert backend.expected_get_s(N * record_bytes(rig.layout.shape)) > 0.2
        gets, connections = backend.stats.gets, proxy.connections
        res = await asyncio.to_thread(rig.load_into, 30)
        assert (res.restored, res.planned) == (0, N)
        assert backend.stats.gets == gets and proxy.connections == connections  # nothing was sent
        assert rig.store.metrics.value("restores_abandoned", reason="estimate") == 1
    finally:
        proxy.set_mode("pass")
        await asyncio.to_thread(rig.store.close)


def _running_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def test_a_read_cancelled_before_it_started_is_done_at_once() -> None:
    """Cancelled before the loop ran its first step, the coroutine never runs; ``wait`` still
    returns (a task's done callback runs for such a cancel too)."""
    loop, thread = _running_loop()
    ran = threading.Event()
    try:
        gate = threading.Event()
        loop.call_soon_threadsafe(gate.wait, 5)  # the loop is busy: the read cannot start yet

        async def read() -> list[int | None]:
            ran.set()
            return [1]

        lr = LoopRead(loop, read())
        lr.cancel()
        gate.set()
        assert lr.wait() is None
        assert not ran.is_set()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_read_whose_loop_stops_gives_up_instead_of_hanging() -> None:
    loop, thread = _running_loop()

    async def never() -> list[int | None]:
        await asyncio.Event().wait()
        return []

    lr = LoopRead(loop, never())
    time.sleep(0.1)
    loop.call_soon_threadsafe(loop.stop)  # as the store's close does
    thread.join(5)
    with pytest.raises(TierUnavailable):
        lr.wait()
