"""A block recomputed after its record failed verification is stored again, whenever the
corrupt record's delete runs (the loop deletes it after the failed load has returned)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from test_store import REC, NamedHost, block_bytes, keys_for, make_layout, make_store

from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.tiers.host import HostTier


class SlowDeleteHost(HostTier):
    """A host tier whose deletes wait for ``gate``: the window between a failed verification and
    the delete of the corrupt record, held open as long as a test needs."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, chunk_bytes=REC, pin=False)
        self.gate = threading.Event()
        self.deletes = 0

    async def delete(self, key: bytes) -> bool:
        self.deletes += 1
        while not self.gate.is_set():  # polled: the loop's executor stays free for the writes
            await asyncio.sleep(0.01)
        return await super().delete(key)


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def _corrupt(host: HostTier, key: bytes) -> None:
    _, chunks = host._index[key]
    host._chunks[chunks[0], REC - 100] ^= 0xFF  # a payload byte: the record fails verification


def test_block_saved_while_its_corrupt_record_awaits_deletion_is_stored(pool: StagingPool) -> None:
    host = SlowDeleteHost(64 * REC)
    src, dst = make_layout(seed=5), make_layout()
    keys = keys_for(4)
    with make_store([host], pool) as store:
        store.submit_offload(src, [1, 2, 3, 4], keys, parents_of(keys))
        assert store.drain(10)
        _corrupt(host, keys[2])
        res = store.load(dst, [5, 6, 7, 8], keys, timeout=10)
        assert res.loaded_block_ids == [5, 6] and res.failed_block_ids == [7, 8]
        # the corrupt record is gone for lookups at once, though its delete has not run yet
        assert store.lookup(keys).num_blocks == 2 and host.contains(keys[2])
        # the engine recomputes blocks 2, 3 and saves them before the delete ran
        assert store.submit_offload(src, [3, 4], keys[2:], parents_of(keys)[2:], first_index=2)
        host.gate.set()
        assert store.drain(10)
        assert host.deletes == 1
        assert store.lookup(keys).num_blocks == 4  # the fresh copy of block 2 outlived the delete
        res = store.load(dst, [9, 10, 11, 12], keys, timeout=10)
        assert res.failed_block_ids == []
        assert block_bytes(src, 3) == block_bytes(dst, 11)


def test_a_record_failing_twice_before_its_delete_is_deleted_once(pool: StagingPool) -> None:
    host = SlowDeleteHost(64 * REC)
    src, dst = make_layout(seed=6), make_layout()
    keys = keys_for(2)
    with make_store([host], pool) as store:
        store.submit_offload(src, [1, 2], keys, parents_of(keys))
        assert store.drain(10)
        _corrupt(host, keys[0])
        assert store.load(dst, [3, 4], keys, timeout=10).failed_block_ids == [3, 4]
        assert store.load(dst, [3, 4], keys, timeout=10).failed_block_ids == [3, 4]  # a miss now
        assert store.metrics.value("checksum_failures_total", tier="host") == 1
        store.submit_offload(src, [1], keys[:1], parents_of(keys)[:1])
        host.gate.set()
        assert store.drain(10)
        assert host.deletes == 1 and store.lookup(keys).num_blocks == 2


def test_lower_tier_copy_serves_while_the_fast_tier_record_awaits_deletion(pool: StagingPool) -> None:
    host, ssd = SlowDeleteHost(64 * REC), NamedHost("ssd", 64 * REC)
    src, dst = make_layout(seed=7), make_layout()
    keys = keys_for(2)
    with make_store([host, ssd], pool) as store:
        store.submit_offload(src, [1, 2], keys, parents_of(keys))
        assert store.drain(10)
        _corrupt(host, keys[1])
        assert store.load(dst, [3, 4], keys, timeout=10).failed_block_ids == [4]
        assert store.lookup(keys).tier_per_block == ("host", "ssd")
        res = store.load(dst, [5, 6], keys, timeout=10)
        assert res.failed_block_ids == [] and res.tier_per_block == ["host", "ssd"]
        host.gate.set()
        assert store.drain(10)
        assert store.lookup(keys).tier_per_block == ("host", "host")  # promoted back after the delete
        assert block_bytes(src, 2) == block_bytes(dst, 6)
