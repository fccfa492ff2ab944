"""A block saved again while its first save to a tier is still in flight is not written twice:
the second ``submit_offload`` skips it (and counts the skip), and a first save that fails or is
dropped leaves the block writable by the next one."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterable, Iterator

import pytest
from test_store import REC, block_bytes, keys_for, make_layout, make_store

from dynamo_tiered_kv.blocks.keys import BlockKey, parents_of
from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.tiers.host import HostTier


class HeldWritesHost(HostTier):
    """A host tier whose batched writes wait for ``gate`` and count every key they write; the
    first ``fail_writes`` batches fail (after the gate) with ``TierUnavailable``."""

    def __init__(self, capacity: int, *, fail_writes: int = 0) -> None:
        super().__init__(capacity, chunk_bytes=REC, pin=False)
        self.gate = threading.Event()
        self.entered = threading.Event()  # a write reached the gate
        self.written: Counter[BlockKey] = Counter()
        self.fail_writes = fail_writes

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview]]) -> None:
        items = list(items)
        self.entered.set()
        while not self.gate.is_set():  # polled: the loop stays free for other work
            await asyncio.sleep(0.01)
        if self.fail_writes > 0:
            self.fail_writes -= 1
            raise TierUnavailable("the tier is down for this write")
        self.written.update(k for k, _ in items)
        await super().write_many(items)


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def test_saving_the_same_blocks_while_their_first_save_is_held_writes_each_once(pool: StagingPool) -> None:
    host = HeldWritesHost(64 * REC)
    src, dst = make_layout(seed=11), make_layout()
    keys = keys_for(4)
    with make_store([host], pool) as store:
        assert store.submit_offload(src, [1, 2, 3, 4], keys, parents_of(keys))
        assert host.entered.wait(10)
        # the engine recomputes the blocks (their first save is not stored yet) and saves them again
        assert store.submit_offload(src, [5, 6, 7, 8], keys, parents_of(keys))
        assert store.writer.pending_offloads == 1  # no second batch was queued
        host.gate.set()
        assert store.drain(10)
        assert host.written == Counter(keys)  # each key written once
        assert store.metrics.value("offload_inflight_skips_total", tier="host") == 4
        assert store.writer.bookkeeping()["saves_in_flight"] == 0  # nothing stays claimed
        res = store.load(dst, [9, 10, 11, 12], keys, timeout=10)
        assert res.failed_block_ids == []
        assert block_bytes(src, 4) == block_bytes(dst, 12)


def test_blocks_saved_from_several_engine_threads_at_once_are_written_once(pool: StagingPool) -> None:
    host = HeldWritesHost(64 * REC)
    src = make_layout(seed=12)
    keys = keys_for(3)
    with make_store([host], pool) as store:
        start = threading.Barrier(4)

        def save() -> None:
            start.wait(10)
            store.submit_offload(src, [1, 2, 3], keys, parents_of(keys))

        threads = [threading.Thread(target=save) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        host.gate.set()
        assert store.drain(10)
        assert host.written == Counter(keys)
        assert store.metrics.value("offload_inflight_skips_total", tier="host") == 9


def test_a_failed_first_save_lets_the_next_save_write_the_blocks(pool: StagingPool) -> None:
    host = HeldWritesHost(64 * REC, fail_writes=1)
    src = make_layout(seed=13)
    keys = keys_for(3)
    with make_store([host], pool) as store:
        assert store.submit_offload(src, [1, 2, 3], keys, parents_of(keys))
        assert host.entered.wait(10)
        assert store.submit_offload(src, [1, 2, 3], keys, parents_of(keys))  # skipped: in flight
        host.gate.set()
        assert store.drain(10)
        assert host.written == Counter() and store.lookup(keys).num_blocks == 0  # the write failed
        assert store.submit_offload(src, [1, 2, 3], keys, parents_of(keys))
        assert store.drain(10)
        assert host.written == Counter(keys)
        assert store.lookup(keys).num_blocks == 3


def test_a_dropped_batch_leaves_its_blocks_writable(pool: StagingPool) -> None:
    host = HeldWritesHost(64 * REC)
    src = make_layout(seed=14)
    keys = keys_for(4)
    with make_store([host], pool, max_pending_offloads=1) as store:
        assert store.submit_offload(src, [1, 2], keys[:2], parents_of(keys)[:2])
        assert host.entered.wait(10)
        # the queue is full: the batch is dropped, and its claims with it
        assert not store.submit_offload(src, [3, 4], keys[2:], parents_of(keys)[2:], first_index=2)
        host.gate.set()
        assert store.drain(10)
        assert store.submit_offload(src, [3, 4], keys[2:], parents_of(keys)[2:], first_index=2)
        assert store.drain(10)
        assert host.written == Counter(keys)
        assert store.lookup(keys).num_blocks == 4


class HoldsAfterFirstRecordHost(HostTier):
    """A host tier whose first batched write stores its first record, then waits for ``gate``
    before the rest: that record can be read (and found corrupt) while its save is in flight."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, chunk_bytes=REC, pin=False)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.written: Counter[BlockKey] = Counter()

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview]]) -> None:
        for n, (key, data) in enumerate(items):
            await self.write(key, data)
            self.written[key] += 1
            if n == 0 and not self.entered.is_set():
                self.entered.set()
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)


def test_a_record_found_corrupt_while_its_save_is_in_flight_is_saved_again(pool: StagingPool) -> None:
    host = HoldsAfterFirstRecordHost(64 * REC)
    src, dst = make_layout(seed=15), make_layout()
    keys = keys_for(3)
    with make_store([host], pool) as store:
        assert store.submit_offload(src, [1, 2, 3], keys, parents_of(keys))
        assert host.entered.wait(10)
        _, chunks = host._index[keys[0]]
        host._chunks[chunks[0], REC - 100] ^= 0xFF  # the stored record fails verification
        assert store.load(dst, [4], keys[:1], timeout=10).failed_block_ids == [4]
        # the engine recomputes block 0 and saves it: its first save no longer stands for it
        assert store.submit_offload(src, [1], keys[:1], parents_of(keys)[:1])
        host.gate.set()
        assert store.drain(10)
        assert host.written[keys[0]] == 2
        res = store.load(dst, [4, 5, 6], keys, timeout=10)
        assert res.failed_block_ids == []
        assert block_bytes(src, 1) == block_bytes(dst, 4)
