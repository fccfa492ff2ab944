"""``TieredStore.retain/expire/prefetch/demote`` over real tiers (host, SSD files, local-dir objects)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.hints import BlockRetention
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.ssd import SSDTier
from tests.test_store import NS, REC, keys_for, make_layout


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def _offload(store: TieredStore, keys: list[bytes]) -> None:
    layout = make_layout(len(keys) + 1, seed=5)
    assert store.submit_offload(layout, list(range(1, len(keys) + 1)), keys, parents_of(keys))
    assert store.drain(20)


def _tiers(tmp_path: Path, host_blocks: int, ssd_bytes: int) -> list:
    return [HostTier(host_blocks * REC, chunk_bytes=REC, pin=False),
            SSDTier(tmp_path / "ssd", capacity_bytes=ssd_bytes, segment_bytes=64 << 10, idle_seal_s=None),
            ObjectTier(LocalDirBackend(tmp_path / "obj"), capacity_bytes=1 << 30, ttl_s=86400.0)]


def test_ssd_eviction_keeps_a_segment_with_a_protected_block(pool: StagingPool, tmp_path: Path) -> None:
    ssd = SSDTier(tmp_path, capacity_bytes=320 << 10, segment_bytes=64 << 10, idle_seal_s=None)
    clock = Clock()
    with TieredStore([ssd], NS, pool, clock=clock) as store:
        first = keys_for(8, start=0)
        store.retain(first[:1], BlockRetention(60, clock.t + 3600))
        _offload(store, first)
        for r in range(1, 12):  # far more than 320 KiB: older segments are evicted all along
            _offload(store, keys_for(8, start=r * 8 * 16))
        assert ssd.contains(first[0])  # its segment is the oldest, but holds a protected block
        assert not ssd.contains(keys_for(8, start=8 * 16)[0])  # the next oldest went


def test_expired_retention_leaves_zero_bytes_in_every_tier(pool: StagingPool, tmp_path: Path) -> None:
    clock = Clock()
    with TieredStore(_tiers(tmp_path, 64, 4 << 20), NS, pool, write_depth=3, clock=clock) as store:
        keys = keys_for(6)
        store.retain(keys, BlockRetention(50, clock.t + 7200))
        _offload(store, keys)
        other = keys_for(4, start=999 * 16)
        _offload(store, other)
        rep = store.expire()
        assert sum(rep.bytes.values()) == 0
        clock.t += 7201  # two simulated hours later
        rep = store.expire()
        assert rep.blocks == {"host": 6, "ssd": 6, "object": 6}
        for t in store.tiers:
            assert not any(t.contains(k) for k in keys), t.name
            assert all(t.contains(k) for k in other), t.name  # never retained: untouched


def test_ttl_sweep_spares_protected_blocks(pool: StagingPool) -> None:
    host = HostTier(32 * REC, chunk_bytes=REC, pin=False)
    with TieredStore([host], NS, pool, ttl_s=[10.0], sweep_interval_s=3600) as store:
        kept, plain = keys_for(3), keys_for(3, start=500)
        store.retain(kept, BlockRetention(80, None))
        _offload(store, kept + plain)
        store.retention.sweep_now(time.monotonic() + 11)
        assert all(host.contains(k) for k in kept) and not any(host.contains(k) for k in plain)


def test_prefetch_promotes_a_prefix_into_host_and_demote_moves_it_down(pool: StagingPool, tmp_path: Path) -> None:
    with TieredStore(_tiers(tmp_path, 64, 4 << 20), NS, pool, write_depth=3) as store:
        keys = keys_for(10)
        _offload(store, keys)
        store.drop_local()
        assert store.drain(10)
        assert not any(store.tiers[0].contains(k) for k in keys)
        assert store.lookup(keys).tier_per_block == ("object",) * 10
        assert store.prefetch_now(keys) == 10
        assert all(store.tiers[0].contains(k) for k in keys)
        layout = make_layout(11)
        res = store.load(layout, list(range(1, 11)), keys)
        assert len(res.loaded_block_ids) == 10 and set(res.tier_per_block) == {"host"}
        assert store.demote(keys) == 10
        assert not any(store.tiers[0].contains(k) for k in keys)
        assert all(store.tiers[1].contains(k) for k in keys)


def test_prefetch_never_evicts_protected_blocks(pool: StagingPool, tmp_path: Path) -> None:
    with TieredStore(_tiers(tmp_path, 8, 4 << 20), NS, pool, write_depth=3, retain_max_share=1.0) as store:
        cold = keys_for(6, start=300)
        _offload(store, cold)
        hot = keys_for(8)
        store.retain(hot, BlockRetention(90, None))
        _offload(store, hot)  # the host tier is full of protected blocks
        assert all(store.tiers[0].contains(k) for k in hot)
        store.prefetch_now(cold)
        assert all(store.tiers[0].contains(k) for k in hot)
        assert store.retention.prefetch_stats.stopped_protected == 1


@pytest.mark.parametrize("hinted", [True, False])
def test_a_retained_session_is_restored_whole_after_a_flood(pool: StagingPool, tmp_path: Path, hinted: bool) -> None:
    """Every tier far smaller than the traffic: the retained session's prefix still restores whole
    (its protected bytes fit the bound); without the hint recency evicts it somewhere."""
    clock = Clock()
    tiers = [HostTier(16 * REC, chunk_bytes=REC, pin=False),
             SSDTier(tmp_path / "ssd", capacity_bytes=48 * REC, segment_bytes=64 << 10, idle_seal_s=None),
             ObjectTier(LocalDirBackend(tmp_path / "obj"), capacity_bytes=40 * REC, ttl_s=None)]
    with TieredStore(tiers, NS, pool, write_depth=3, clock=clock) as store:
        session = keys_for(12, start=7)
        if hinted:
            store.retain(session, BlockRetention(50, clock.t + 7200))
        _offload(store, session)
        for r in range(20):  # other sessions: 160 blocks through tiers of 16-48
            clock.t += 60
            _offload(store, keys_for(8, start=1000 + r * 8 * 16))
        res = store.load(make_layout(13), list(range(1, 13)), session)
        assert (len(res.loaded_block_ids) == 12) is hinted
