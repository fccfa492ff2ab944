"""TieredStore: offload -> lookup -> load round trips, admission, promotion, failures, drops."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dynamo_tiered_kv.blocks.codec import encode_blocks, record_bytes
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store.store import Admission, TieredStore
from dynamo_tiered_kv.tiers.base import ByteRange, Tier, TierCapabilities
from dynamo_tiered_kv.tiers.host import HostTier

BS, LAYERS, HEADS, HEAD = 16, 2, 2, 32
NS = Namespace("tiny", "bfloat16", "VLLM_CPU", BS, LAYERS, HEADS, HEAD)


def make_layout(num_blocks: int = 16, seed: int | None = None) -> EngineLayout:
    tensors = allocate_engine_kv(
        EngineLayoutKind.VLLM_CPU,
        num_layers=LAYERS,
        num_blocks=num_blocks,
        block_size=BS,
        num_kv_heads=HEADS,
        head_size=HEAD,
    )
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return EngineLayout(EngineLayoutKind.VLLM_CPU, tensors, BS, HEADS, HEAD)


def block_bytes(layout: EngineLayout, block_id: int) -> bytes:
    return b"".join(t[block_id].contiguous().view(torch.uint8).numpy().tobytes() for t in layout.tensors)


REC = record_bytes(make_layout(1).shape)


def keys_for(n: int, ns: Namespace = NS, start: int = 0) -> list[bytes]:
    return chain_keys(ns, np.arange(start, start + n * BS) % 1000)


class NamedHost(HostTier):
    """A second in-memory tier standing in for a slower one (distinct name)."""

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(capacity, chunk_bytes=REC, pin=False)
        self.name = name
        # report the medium of the tier it stands in for: admission treats storage differently
        self.capabilities = TierCapabilities(medium=name if name in ("ssd", "object") else "host",
                                             durable=False, shared=False)


class GatedTier(NamedHost):
    """Blocks reads/writes until ``gate`` is set; ``down`` makes every call raise TierUnavailable."""

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name, capacity)
        self.gate = threading.Event()
        self.gate.set()
        self.down = False

    async def _wait(self) -> None:
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        if self.down:
            raise TierUnavailable(f"{self.name} is down")

    async def read_into(self, key, into, byte_range: ByteRange | None = None):
        await self._wait()
        return await super().read_into(key, into, byte_range)

    async def write(self, key, data) -> None:
        await self._wait()
        await super().write(key, data)


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def make_store(tiers: list[Tier], pool: StagingPool, **kw) -> TieredStore:
    return TieredStore(tiers, NS, pool, **kw)


def test_offload_lookup_load_round_trip(pool: StagingPool) -> None:
    src, dst = make_layout(seed=1), make_layout()
    keys = keys_for(5)
    with make_store([HostTier(64 * REC, chunk_bytes=REC, pin=False)], pool) as store:
        assert store.lookup(keys).num_blocks == 0
        assert store.submit_offload(src, [1, 2, 3, 4, 5], keys, parents_of(keys))
        assert store.drain(10)
        lk = store.lookup(keys)
        assert lk.num_blocks == 5 and lk.tier_per_block == ("host",) * 5
        res = store.load(dst, [7, 8, 9, 10, 11], keys, timeout=10)
        assert res.loaded_block_ids == [7, 8, 9, 10, 11] and res.failed_block_ids == []
        for s, d in zip([1, 2, 3, 4, 5], [7, 8, 9, 10, 11], strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        assert store.metrics.value("tier_hits_total", tier="host") == 5
        assert pool.free_count == 4


def test_lookup_stops_at_first_gap_and_uses_fastest_tier(pool: StagingPool) -> None:
    host, ssd = HostTier(64 * REC, chunk_bytes=REC, pin=False), NamedHost("ssd", 64 * REC)
    keys = keys_for(4)
    with make_store([host, ssd], pool) as store:
        layout = make_layout(seed=2)
        store.submit_offload(layout, [1, 2, 4], [keys[0], keys[1], keys[3]], [keys[0]] * 3)
        store.drain(10)
        asyncio.run(host.delete(keys[0]))
        lk = store.lookup(keys)
        assert lk.num_blocks == 2 and lk.tier_per_block == ("ssd", "host")


def test_load_from_lower_tier_promotes_into_host(pool: StagingPool) -> None:
    host, ssd = HostTier(64 * REC, chunk_bytes=REC, pin=False), NamedHost("ssd", 64 * REC)
    src, dst = make_layout(seed=3), make_layout()
    keys = keys_for(3)
    with make_store([host, ssd], pool) as store:
        store.submit_offload(src, [1, 2, 3], keys, parents_of(keys))
        store.drain(10)
        for k in keys:
            asyncio.run(host.delete(k))
        assert store.lookup(keys).tier_per_block == ("ssd",) * 3
        res = store.load(dst, [4, 5, 6], keys, timeout=10)
        assert res.loaded_block_ids == [4, 5, 6] and res.tier_per_block == ["ssd"] * 3
        store.drain(10)
        assert store.lookup(keys).tier_per_block == ("host",) * 3
        assert block_bytes(src, 3) == block_bytes(dst, 6)


def test_corrupt_record_fails_that_block_and_the_rest(pool: StagingPool) -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    src, dst = make_layout(seed=4), make_layout()
    keys = keys_for(4)
    with make_store([host], pool) as store:
        store.submit_offload(src, [1, 2, 3, 4], keys, parents_of(keys))
        store.drain(10)
        _, chunks = host._index[keys[1]]
        host._chunks[chunks[0], REC - 100] ^= 0xFF  # flip a payload byte of block 2
        res = store.load(dst, [5, 6, 7, 8], keys, timeout=10)
        assert res.loaded_block_ids == [5] and res.failed_block_ids == [6, 7, 8]
        assert store.metrics.value("checksum_failures_total", tier="host") == 1
        store.drain(10)
        assert store.lookup(keys).num_blocks == 1  # the corrupt record was dropped


def test_other_namespace_never_served(pool: StagingPool) -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    keys = keys_for(1)
    rec = np.zeros(REC, dtype=np.uint8)
    encode_blocks(make_layout(seed=5), [1], [NS.digest], keys, keys, rec)  # written by tenant ""
    other = dataclasses.replace(NS, tenant_salt="tenant-b")
    with TieredStore([host], other, pool) as store:
        asyncio.run(host.write(keys[0], memoryview(rec)))
        res = store.load(make_layout(), [3], keys, timeout=10)
        assert res.failed_block_ids == [3] and res.loaded_block_ids == []
        assert store.metrics.value("checksum_failures_total", tier="host") == 1


def test_unavailable_tier_fails_open(pool: StagingPool) -> None:
    host, obj = HostTier(64 * REC, chunk_bytes=REC, pin=False), GatedTier("object", 64 * REC)
    keys = keys_for(3)
    with make_store([host, obj], pool) as store:
        store.submit_offload(make_layout(seed=7), [1, 2, 3], keys, parents_of(keys))
        store.drain(10)
        asyncio.run(host.delete(keys[2]))
        obj.down = True
        res = store.load(make_layout(), [4, 5, 6], keys, timeout=10)
        assert res.loaded_block_ids == [4, 5] and res.failed_block_ids == [6]
        assert store.metrics.value("tier_errors_total", tier="object", op="read") == 1
        # Writes to the failed tier are counted, not raised, and the host copy still lands.
        more = keys_for(2, start=500)
        assert store.submit_offload(make_layout(seed=8), [1, 2], more, parents_of(more))
        assert store.drain(10)
        assert store.lookup(more).tier_per_block == ("host", "host")
        assert store.metrics.value("tier_errors_total", tier="object", op="write") >= 1


def test_offload_never_blocks_and_drops_under_pressure() -> None:
    pool = StagingPool(2 * REC, 1, pin=False)
    slow = GatedTier("ssd", 64 * REC)
    slow.gate.clear()
    try:
        with TieredStore([HostTier(64 * REC, chunk_bytes=REC, pin=False), slow], NS, pool) as store:
            layout = make_layout(seed=9)
            a, b = keys_for(2), keys_for(2, start=300)
            assert store.submit_offload(layout, [1, 2], a, parents_of(a))  # holds the only slab
            assert not store.submit_offload(layout, [3, 4], b, parents_of(b))  # returns at once
            assert store.metrics.value("offload_dropped_total", reason="no_staging") == 1
            slow.gate.set()
            assert store.drain(10)
            assert store.lookup(a).tier_per_block == ("host", "host")
            assert store.lookup(b).num_blocks == 0
            assert pool.free_count == 1
    finally:
        pool.close()


def test_queue_bound_drops(pool: StagingPool) -> None:
    slow = GatedTier("host", 64 * REC)
    slow.gate.clear()
    with make_store([slow], pool, max_pending_offloads=1) as store:
        layout = make_layout(seed=10)
        a, b = keys_for(1), keys_for(1, start=700)
        assert store.submit_offload(layout, [1], a, parents_of(a))
        assert not store.submit_offload(layout, [2], b, parents_of(b))
        assert store.metrics.value("offload_dropped_total", reason="queue_full") == 1
        slow.gate.set()
        assert store.drain(10)


def test_second_hit_admission_and_min_prefix(pool: StagingPool) -> None:
    host, ssd = HostTier(64 * REC, chunk_bytes=REC, pin=False), NamedHost("ssd", 64 * REC)
    keys = keys_for(3)
    adm = Admission("second_hit", min_prefix_blocks=2)
    with make_store([host, ssd], pool, admission=adm) as store:
        layout = make_layout(seed=11)
        assert store.submit_offload(layout, [1], keys[:1], parents_of(keys[:1]))  # too short: skipped
        store.drain(10)
        assert store.lookup(keys).num_blocks == 0
        store.submit_offload(layout, [1, 2, 3], keys, parents_of(keys))
        store.drain(10)
        assert all(host.contains(k) for k in keys) and not any(ssd.contains(k) for k in keys)
        # Seen again (loaded from host): now admitted to the SSD tier.
        res = store.load(make_layout(), [4, 5, 6], keys, timeout=10)
        assert res.failed_block_ids == []
        store.drain(10)
        assert all(ssd.contains(k) for k in keys)


def test_load_timeout_reports_failure_and_frees_slab(pool: StagingPool) -> None:
    slow = GatedTier("object", 64 * REC)
    keys = keys_for(2)
    with make_store([slow], pool) as store:
        store.submit_offload(make_layout(seed=12), [1, 2], keys, parents_of(keys))
        store.drain(10)
        slow.gate.clear()
        res = store.load(make_layout(), [3, 4], keys, timeout=0.2)
        assert res.loaded_block_ids == [] and res.failed_block_ids == [3, 4]
        slow.gate.set()
        for _ in range(200):
            if pool.free_count == 4:
                break
            threading.Event().wait(0.01)
        assert pool.free_count == 4


def test_ttl_sweep_deletes_expired_blocks(pool: StagingPool) -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    keys = keys_for(2)
    with make_store([host], pool, ttl_s=[60.0], sweep_interval_s=3600) as store:
        store.submit_offload(make_layout(seed=13), [1, 2], keys, parents_of(keys))
        store.drain(10)
        assert store.retention.sweep_now() == 0
        import time

        assert store.retention.sweep_now(time.monotonic() + 61) == 2
        assert store.lookup(keys).num_blocks == 0


def test_out_of_range_block_ids_are_refused(pool: StagingPool) -> None:
    keys = keys_for(1)
    with make_store([HostTier(64 * REC, chunk_bytes=REC, pin=False)], pool) as store:
        with pytest.raises(ValueError, match="block ids"):
            store.submit_offload(make_layout(4), [4], keys, keys)
        with pytest.raises(ValueError, match="block ids"):
            store.load(make_layout(4), [-1], keys)


def test_closed_store_drops(pool: StagingPool) -> None:
    store = make_store([HostTier(64 * REC, chunk_bytes=REC, pin=False)], pool)
    store.close()
    keys = keys_for(1)
    assert not store.submit_offload(make_layout(seed=14), [1], keys, parents_of(keys))
    assert store.load(make_layout(), [1], keys).failed_block_ids == [1]
    store.close()  # idempotent


def test_chunked_load_pipelines_and_frees_every_slab_on_failure(pool: StagingPool) -> None:
    host, ssd = HostTier(64 * REC, chunk_bytes=REC, pin=False), NamedHost("ssd", 64 * REC)
    src, dst = make_layout(32, seed=15), make_layout(32)
    keys = keys_for(12)
    with make_store([host, ssd], pool, load_chunk_bytes=2 * REC) as store:  # 6 chunks of 2 blocks
        store.submit_offload(src, list(range(1, 13)), keys, parents_of(keys))
        store.drain(10)
        for k in keys[4:8]:
            asyncio.run(host.delete(k))  # a middle run only in the lower tier
        res = store.load(dst, list(range(13, 25)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(13, 25))
        assert res.tier_per_block == ["host"] * 4 + ["ssd"] * 4 + ["host"] * 4
        for s, d in zip(range(1, 13), range(13, 25), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        store.drain(10)
        _, chunks = host._index[keys[6]]  # promoted back into host; now damage it
        host._chunks[chunks[0], REC - 100] ^= 0xFF
        res = store.load(make_layout(32), list(range(13, 25)), keys, timeout=10)
        assert len(res.loaded_block_ids) == 6 and len(res.failed_block_ids) == 6
        store.drain(10)
        assert pool.free_count == 4  # prefetched chunks after the failure gave their slabs back


def test_broken_decode_fails_the_load_and_frees_the_slab(pool: StagingPool, monkeypatch: pytest.MonkeyPatch) -> None:
    import dynamo_tiered_kv.store.reads.pipeline as store_mod

    keys = keys_for(3)
    with make_store([HostTier(64 * REC, chunk_bytes=REC, pin=False)], pool) as store:
        store.submit_offload(make_layout(seed=13), [1, 2, 3], keys, parents_of(keys))
        assert store.drain(10)

        def broken(*a, **k):
            raise RuntimeError("simulated CUDA OOM in scatter")

        monkeypatch.setattr(store_mod, "decode_blocks", broken)
        monkeypatch.setattr(store_mod, "decode_records", broken)  # host records are decoded in place
        for _ in range(3):  # more loads than slabs: a leak would starve the later ones
            res = store.load(make_layout(), [4, 5, 6], keys, timeout=2)
            assert res.loaded_block_ids == [] and res.failed_block_ids == [4, 5, 6]
        assert pool.free_count == 4


def test_second_hit_guards_storage_even_without_a_host_tier(pool: StagingPool) -> None:
    ssd = NamedHost("ssd", 64 * REC)
    keys = keys_for(2)
    with make_store([ssd], pool, admission=Admission("second_hit")) as store:
        layout = make_layout(seed=14)
        store.submit_offload(layout, [1, 2], keys, parents_of(keys))
        store.drain(10)
        assert not any(ssd.contains(k) for k in keys)  # seen once: not worth an SSD write
        store.submit_offload(layout, [1, 2], keys, parents_of(keys))
        store.drain(10)
        assert all(ssd.contains(k) for k in keys)


class _StuckFlusher:
    """Write-back that never finishes and ignores its drain timeout (an object store hanging)."""

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        pass

    async def drain(self, timeout: float | None = None) -> bool:
        await asyncio.sleep(3600)
        return True


def test_close_by_keeps_its_deadline_with_stuck_writes_and_write_back(pool: StagingPool) -> None:
    import time

    slow = GatedTier("ssd", 64 * REC)
    store = make_store([HostTier(64 * REC, chunk_bytes=REC, pin=False), slow], pool, background=[_StuckFlusher()])
    layout, keys = make_layout(seed=1), keys_for(4)
    slow.gate.clear()  # the SSD write never returns
    assert store.submit_offload(layout, [0, 1, 2, 3], keys, parents_of(keys))
    t0 = time.monotonic()
    store.close_by(t0 + 1.0)
    assert time.monotonic() - t0 < 2.5  # the deadline plus at most a second to stop the loop
    assert store.closed and not store.submit_offload(layout, [4], keys_for(1, start=4), parents_of(keys_for(1)))
    slow.gate.set()


def test_concurrent_closes_close_once(pool: StagingPool) -> None:
    closes: list[str] = []

    class Counting(GatedTier):
        async def close(self) -> None:
            closes.append(self.name)
            await super().close()

    tier = Counting("host", 64 * REC)
    store = make_store([tier], pool)
    layout, keys = make_layout(seed=1), keys_for(2)
    tier.gate.clear()  # every closer waits in drain, then all race to shut down
    assert store.submit_offload(layout, [0, 1], keys, parents_of(keys))
    errors: list[BaseException] = []

    def close() -> None:
        try:
            store.close(5)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=close) for _ in range(4)]
    for t in threads:
        t.start()
    threading.Event().wait(0.3)
    tier.gate.set()
    for t in threads:
        t.join(30)
    assert errors == [] and closes == ["host"] and store.closed
