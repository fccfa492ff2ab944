"""The store's parts built alone with real tiers: ``StoreState``, ``OffloadWriter``, ``ChunkReader``,
``RetentionService``; and the store reaching tiers through the ``Tier`` contract only."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.blocks.codec import encode_blocks
from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.hints import BlockRetention
from dynamo_tiered_kv.policy.admission import Admission, Retention
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.store.metrics import StoreMetrics
from dynamo_tiered_kv.store.reads.pipeline import ChunkReader
from dynamo_tiered_kv.store.reads.stages import LoadStages
from dynamo_tiered_kv.store.retention import RetentionService
from dynamo_tiered_kv.store.state import StoreState
from dynamo_tiered_kv.store.writes import OffloadWriter
from dynamo_tiered_kv.testing.clock import ManualClock as Clock
from dynamo_tiered_kv.tiers.base import TierExpiry
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.ssd import SSDTier
from tests.test_store import NS, REC, block_bytes, keys_for, make_layout


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    th = threading.Thread(target=lp.run_forever, name="parts-loop", daemon=True)
    th.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    th.join(5)
    lp.close()


@pytest.fixture
def pool() -> StagingPool:
    return StagingPool(8 * REC, 4, pin=False)


def _state(tiers: list, loop: asyncio.AbstractEventLoop) -> StoreState:
    state = StoreState(tiers, StoreMetrics(tiers), [Retention(None, t.contains, lambda: 0) for t in tiers], loop, 8)
    for t in tiers:
        state.call(t.open(), timeout=30)
    return state


def _records(n: int, seed: int = 1) -> tuple[list[bytes], np.ndarray, object]:
    layout = make_layout(n, seed=seed)
    keys = keys_for(n)
    out = np.empty(n * REC, dtype=np.uint8)
    encode_blocks(layout, list(range(n)), [NS.digest] * n, keys, parents_of(keys), out)
    return keys, out, layout


def test_state_condemned_record_is_gone_at_once_and_deleted_by_the_loop(loop: asyncio.AbstractEventLoop) -> None:
    host = HostTier(8 * REC, chunk_bytes=REC, pin=False)
    state = _state([host], loop)
    keys, recs, _ = _records(2)
    state.call(host.write_many([(k, memoryview(recs[i * REC:(i + 1) * REC])) for i, k in enumerate(keys)]))
    assert state.fastest(keys[0]) == 0
    state.condemn(0, keys[0])
    assert not state.holds(0, keys[0]) and state.fastest(keys[0]) is None  # before the delete ran
    assert state.drain(10)
    assert not host.contains(keys[0]) and not state.condemned
    assert state.holds(0, keys[1])  # the other record is untouched


def test_writer_alone_writes_tracks_and_waits_for_a_condemned_delete(loop: asyncio.AbstractEventLoop,
                                                                     pool: StagingPool) -> None:
    host = HostTier(8 * REC, chunk_bytes=REC, pin=False)
    state = _state([host], loop)
    writer = OffloadWriter(state, pool, None, Admission("always"), 1, NS.digest)
    keys, recs, _ = _records(3)
    assert writer.submit_offload(make_layout(3, seed=1), [0, 1, 2], keys, parents_of(keys))
    assert state.drain(10)
    assert all(host.contains(k) for k in keys) and state.record_nbytes == REC
    # a record that failed verification: its fresh copy is written only after the delete
    state.condemn(0, keys[0])
    state.call(writer.write_tier(0, [(keys[0], memoryview(recs[:REC]))]), timeout=10)
    assert state.drain(10) and host.contains(keys[0]) and state.holds(0, keys[0])
    assert not writer.gpu_direct(0)  # host memory: no device I/O


def test_reader_alone_restores_from_ssd(loop: asyncio.AbstractEventLoop, pool: StagingPool, tmp_path: Path) -> None:
    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, segment_bytes=64 << 10, idle_seal_s=None)
    state = _state([ssd], loop)
    writer = OffloadWriter(state, pool, None, Admission("always"), 1, NS.digest)
    reader = ChunkReader(state, pool, writer, writer.admission, write_depth=1, ns_digest=NS.digest,
                         load_chunk_bytes=2 * REC, load_first_chunk_bytes=REC, load_depth=2)
    keys, recs, src = _records(5, seed=7)
    state.call(writer.write_tier(0, [(k, memoryview(recs[i * REC:(i + 1) * REC])) for i, k in enumerate(keys)]))
    dst = make_layout(5)
    loaded: list[int] = []
    tiers_of: list[str] = []
    st = LoadStages()
    reader.load_pipelined(dst, [4, 3, 2, 1, 0], keys, 30.0, loaded, tiers_of, st)
    assert loaded == [4, 3, 2, 1, 0] and set(tiers_of) == {ssd.name}
    assert all(block_bytes(dst, 4 - i) == block_bytes(src, i) for i in range(5))  # type: ignore[arg-type]
    assert reader._read_shape(0) == (max(1, ssd.read_parallelism or ssd.max_concurrency), ssd.read_piece_bytes)
    assert state.drain(10)
    state.call(ssd.close(), timeout=30)


class CountingHost(HostTier):
    """A host tier that counts the store's calls of the contract's expire and seal."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, chunk_bytes=REC, pin=False)
        self.expire_calls: list[float] = []
        self.seals = 0

    async def expire(self, now: float, max_bytes: int) -> TierExpiry:
        self.expire_calls.append(now)
        return await super().expire(now, max_bytes)

    async def seal(self) -> None:
        self.seals += 1


def test_retention_service_alone_configures_the_tier_and_expires_through_it(loop: asyncio.AbstractEventLoop,
                                                                            pool: StagingPool) -> None:
    clock = Clock(1_000_000.0)
    host = CountingHost(8 * REC)
    state = _state([host], loop)
    writer = OffloadWriter(state, pool, None, Admission("always"), 1, NS.digest)
    service = RetentionService(state, pool, writer.write_tier, max_share=0.25, clock=clock, expire_interval_s=0)
    assert service.retention_of(0) is host.retention and host.retention.clock is clock
    assert service.background() == []  # no TTL, no periodic expiry
    keys, recs, _ = _records(3)
    state.call(writer.write_tier(0, [(k, memoryview(recs[i * REC:(i + 1) * REC])) for i, k in enumerate(keys)]))
    assert service.retain(keys[:1], BlockRetention(50, clock.t + 60)) == 1
    assert service.retain(keys[1:2], BlockRetention(50, clock.t + 600)) == 1
    clock.t += 61
    rep = service.expire()
    assert host.expire_calls == [clock.t] and rep.blocks == {host.name: 1} and rep.bytes == {host.name: REC}
    assert not host.contains(keys[0]) and host.contains(keys[1]) and host.contains(keys[2])


def test_store_uses_the_tier_contract_for_expire_seal_and_retention(pool: StagingPool) -> None:
    clock = Clock(1_000_000.0)
    host = CountingHost(8 * REC)
    with TieredStore([host], NS, pool, clock=clock, expire_interval_s=0, retain_max_share=0.25) as store:
        assert store.retention.retention_of(0) is host.retention and host.retention.clock is clock
        store.expire()
        assert host.expire_calls == [clock.t]  # the tier's own pass, whatever its medium
        store.persist(5)
        assert host.seals == 1
