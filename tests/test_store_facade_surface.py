"""``TieredStore`` keeps the engine-facing API and nothing else: what reads a part's tables and
counters goes through the part (``store.writer``, ``store.reader``, ``store.retention``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.store.reads.pipeline import ChunkReader
from dynamo_tiered_kv.store.retention import PrefetchStats, RetentionService
from dynamo_tiered_kv.store.writes import OffloadWriter
from dynamo_tiered_kv.testing.clock import ManualClock
from dynamo_tiered_kv.tiers.host import HostTier
from tests.test_store import NS, REC, keys_for, make_layout

#: what an engine adapter calls
ENGINE_API = {"lookup", "submit_offload", "load", "load_into", "retain", "prefetch", "prefetch_now", "demote", "expire",
              "drain", "persist", "close", "close_by", "suspend_device", "resume_device", "drop_local",
              "set_residency", "closed"}
#: the parts, read-only
PARTS = {"writer", "reader", "retention"}
#: what the store was built with and serves (``exit_timeout_s``: ``lifecycle.Closable``)
BUILT_WITH = {"tiers", "namespace", "staging", "device_staging", "metrics", "metrics_port", "exit_timeout_s"}


@pytest.fixture
def store() -> Iterator[TieredStore]:
    host = HostTier(8 * REC, chunk_bytes=REC, pin=False)
    with TieredStore([host], NS, StagingPool(8 * REC, 2, pin=False), ttl_s=[60.0], clock=ManualClock(1_000.0),
                     expire_interval_s=0) as s:
        yield s


def test_public_members_are_the_engine_facing_api_the_parts_and_what_it_was_built_with(store: TieredStore) -> None:
    public = {name for name in dir(store) if not name.startswith("_")}
    assert public == ENGINE_API | PARTS | BUILT_WITH, (sorted(public - ENGINE_API - PARTS - BUILT_WITH),
                                                        sorted((ENGINE_API | PARTS | BUILT_WITH) - public))
    assert hasattr(TieredStore, "__enter__") and hasattr(TieredStore, "__exit__")


def test_parts_are_read_only_attributes_of_the_right_kind(store: TieredStore) -> None:
    assert isinstance(store.writer, OffloadWriter)
    assert isinstance(store.reader, ChunkReader)
    assert isinstance(store.retention, RetentionService)
    for name in sorted(PARTS):
        with pytest.raises(AttributeError):
            setattr(store, name, None)


def test_the_moved_members_answer_on_their_parts(store: TieredStore) -> None:
    host = store.tiers[0]
    keys = keys_for(3)
    assert store.submit_offload(make_layout(3, seed=3), [0, 1, 2], keys, parents_of(keys))
    assert store.drain(10)
    writer, retention = store.writer, store.retention
    assert writer.pending_offloads == 0 and writer.max_pending_offloads == 64
    assert writer.bookkeeping() == {"retention_host": 3, "admission_keys": 3, "loop_tasks": 0,
                                    "pending_offloads": 0, "saves_in_flight": 0}
    assert retention.retention_of(0) is host.retention
    assert retention.clock() == 1_000.0 and retention.expire_passes == 0
    assert retention.prefetch_stats == PrefetchStats()
    retention.note_record_bytes(REC)
    assert retention.sweep_now() == 0  # nothing older than the TTL yet
    assert retention.sweep_now(time.monotonic() + 61) == 3 and not any(host.contains(k) for k in keys)
    assert writer.bookkeeping()["retention_host"] == 0
