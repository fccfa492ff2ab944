"""Retention tracking (TTL sweeps) holds at most what the tiers hold, however much was written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.policy.admission import Retention
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.ssd import SSDTier
from tests.test_store import NS, REC, keys_for, make_layout


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def _write_rounds(store: TieredStore, rounds: int, per_round: int = 8) -> None:
    layout = make_layout(per_round + 1, seed=3)
    for r in range(rounds):
        keys = keys_for(per_round, start=r * per_round * 16)
        assert store.submit_offload(layout, list(range(1, per_round + 1)), keys, parents_of(keys))
        assert store.drain(10)


def test_retention_of_evicted_host_blocks_is_dropped(pool: StagingPool) -> None:
    host = HostTier(16 * REC, chunk_bytes=REC, pin=False)  # holds 16 blocks
    with TieredStore([host], NS, pool, ttl_s=[3600.0], sweep_interval_s=3600) as store:
        _write_rounds(store, 40)  # 320 blocks written
        held = host.usage().num_blocks
        assert held <= 16
        assert store.writer.bookkeeping()["retention_host"] <= held


def test_retention_of_evicted_ssd_blocks_is_dropped(pool: StagingPool, tmp_path: Path) -> None:
    ssd = SSDTier(tmp_path, capacity_bytes=640 << 10, segment_bytes=128 << 10, idle_seal_s=None)
    with TieredStore([ssd], NS, pool, ttl_s=[3600.0], sweep_interval_s=3600) as store:
        _write_rounds(store, 40)  # 320 records of ~8 KiB into 640 KiB: segments evicted all along
        held = ssd.usage().num_blocks
        assert held < 320
        assert store.writer.bookkeeping()["retention_ssd"] <= held


def test_batch_larger_than_the_tier_tracks_only_what_it_kept(pool: StagingPool) -> None:
    big = StagingPool(32 * REC, 2, pin=False)
    host = HostTier(16 * REC, chunk_bytes=REC, pin=False)
    try:
        with TieredStore([host], NS, big, ttl_s=[3600.0], sweep_interval_s=3600) as store:
            _write_rounds(store, 4, per_round=24)  # each batch evicts its own first 8 records
            assert store.writer.bookkeeping()["retention_host"] <= host.usage().num_blocks == 16
    finally:
        big.close()


def test_unreported_drops_are_pruned_to_the_tier_block_count(pool: StagingPool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier that drops blocks without telling (no hook: another node's GC, say) still bounds it."""
    monkeypatch.setattr(Retention, "PRUNE_SLACK", 8)
    host = HostTier(16 * REC, chunk_bytes=REC, pin=False)
    with TieredStore([host], NS, pool, ttl_s=[3600.0], sweep_interval_s=3600) as store:
        host.set_residency_hook(None)  # evictions go unreported
        _write_rounds(store, 40)
        assert store.writer.bookkeeping()["retention_host"] <= 2 * 16 + 8 + 8  # bound + one round written after a prune


def test_ttl_still_expires_blocks_the_tier_keeps(pool: StagingPool) -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    with TieredStore([host], NS, pool, ttl_s=[60.0], sweep_interval_s=3600) as store:
        _write_rounds(store, 2)
        assert store.writer.bookkeeping()["retention_host"] == 16
        import time

        assert store.retention.sweep_now(time.monotonic() + 61) == 16
        assert store.writer.bookkeeping()["retention_host"] == 0 and host.usage().num_blocks == 0


def test_deleted_corrupt_and_dropped_blocks_leave_retention(pool: StagingPool) -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    with TieredStore([host], NS, pool, ttl_s=[3600.0], sweep_interval_s=3600) as store:
        _write_rounds(store, 2)
        store.drop_local()
        assert store.drain(10)
        assert store.writer.bookkeeping()["retention_host"] == 0
