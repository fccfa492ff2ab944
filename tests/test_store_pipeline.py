"""TieredStore load pipeline: chunks read ahead, runs read as concurrent pieces, host
records verified in place; ordering, partial failures, timeouts, slab release, stage timings."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import dynamo_tiered_kv.store.reads.pipeline as sr
from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.errors import TierFull, TierUnavailable
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store.reads.pipeline import _split
from dynamo_tiered_kv.store.reads.stages import union_length
from dynamo_tiered_kv.tiers.host import HostTier
from tests.test_store import NS, REC, GatedTier, NamedHost, block_bytes, keys_for, make_layout, make_store


class PieceTier(NamedHost):
    """An SSD stand-in read in concurrent pieces; pieces finish in reverse order; may fail some keys."""

    read_parallelism = 4
    load_chunk_bytes = None  # chunked like a device tier, not like host memory

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name, capacity)
        self.calls: list[int] = []
        self.fail_keys: set[bytes] = set()
        self.raise_keys: set[bytes] = set()
        self.in_flight = 0
        self.max_in_flight = 0

    async def read_many(self, requests):
        self.calls.append(len(requests))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            # later pieces answer first: ordering must come from slots, not completion order
            await asyncio.sleep(0.002 * (8 - min(len(self.calls), 8)))
            if any(r.key in self.raise_keys for r in requests):
                raise TierUnavailable("piece failed")
            out = []
            for r in requests:
                out.append(None if r.key in self.fail_keys else self.read_sync(r.key, r.into))
            return out
        finally:
            self.in_flight -= 1


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 6, pin=False)
    yield p
    p.close()


def _filled(tiers, pool, n, **kw):
    src = make_layout(64, seed=21)
    keys = keys_for(n)
    store = make_store(tiers, pool, **kw)
    store.submit_offload(src, list(range(1, n + 1)), keys, parents_of(keys))
    assert store.drain(10)
    return store, src, keys


def _load_back(store, src, keys, first_dst: int = 30):
    """Load every key into engine blocks from ``first_dst`` on; all restored, byte for byte the
    offloaded blocks 1..n. Returns the ``LoadResult``."""
    n = len(keys)
    dst, ids = make_layout(64), list(range(first_dst, first_dst + n))
    res = store.load(dst, ids, keys, timeout=10)
    assert res.loaded_block_ids == ids
    for s, d in zip(range(1, n + 1), ids, strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    return res


def test_pieces_keep_order_and_stages_are_reported(pool: StagingPool, monkeypatch) -> None:
    monkeypatch.setattr(sr, "MIN_PIECE_BYTES", REC)  # tiny records: let every run split
    ssd = PieceTier("ssd", 64 * REC)
    store, src, keys = _filled([ssd], pool, 24, load_chunk_bytes=8 * REC, load_first_chunk_bytes=2 * REC)
    with store:
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 54)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(30, 54)) and not res.failed_block_ids
        for s, d in zip(range(1, 25), range(30, 54), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        assert ssd.max_in_flight > 1  # pieces (and chunks) overlapped
        assert max(ssd.calls) < 8  # a run is cut into pieces, not one read
        st = res.stages
        assert st.chunks == 4  # 2 + 8 + 8 + 6 blocks: a small first chunk
        assert st.read_bytes == {"ssd": 24 * REC}
        assert 0 < st.read_s["ssd"] <= st.total_s and st.decode_s > 0 and st.wait_s <= st.total_s
        assert store.metrics.value("restore_bytes_total", tier="ssd") == 24 * REC
        assert store.metrics.value("restore_stage_seconds_count", stage="read", tier="ssd") == 1
        assert pool.free_count == 6


def test_a_load_of_at_most_one_chunk_is_one_chunk_and_one_ssd_read(pool: StagingPool, tmp_path) -> None:
    """A small prefix has nothing to overlap its first chunk with: split, it pays a second read
    (and wake-up) in sequence. Real SSD tier, O_DIRECT segment file."""
    from dynamo_tiered_kv.tiers.ssd import SSDTier

    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=64 * REC, segment_bytes=64 * REC, io="odirect")
    store, src, keys = _filled([ssd], pool, 6, load_chunk_bytes=8 * REC, load_first_chunk_bytes=2 * REC)
    with store:
        before = ssd.io_stats["read_requests"]
        res = _load_back(store, src, keys)
        assert res.stages.chunks == 1
        assert ssd.io_stats["read_requests"] - before == 1  # the records lie back to back: one preadv
    _all_slabs_back(pool)


def test_a_one_chunk_ssd_load_reads_on_one_helper_not_through_the_loop(pool: StagingPool, tmp_path) -> None:
    """No hand-off to the store's loop and an I/O thread and back for a small restore: one read
    on a helper the caller can stop waiting for (on the caller when the load has no deadline); a
    load of several chunks still reads on the loop (read-ahead overlapping verify+scatter)."""
    from dynamo_tiered_kv.tiers.ssd import SSDTier

    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=64 * REC, segment_bytes=64 * REC, io="odirect")
    # 6 blocks: more than one chunk, but one slab (8 records): read whole, on the calling thread
    store, src, keys = _filled([ssd], pool, 12, load_chunk_bytes=4 * REC, load_first_chunk_bytes=2 * REC)
    threads: list[tuple[str, threading.Thread]] = []
    now, later = ssd.read_slab_now, ssd.read_slab

    def spy_now(*a):
        threads.append(("now", threading.current_thread()))
        return now(*a)

    async def spy_later(*a):
        threads.append(("loop", threading.current_thread()))
        return await later(*a)

    ssd.read_slab_now, ssd.read_slab = spy_now, spy_later  # type: ignore[method-assign]
    with store:
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 36)), keys[:6], timeout=10)
        assert res.loaded_block_ids == list(range(30, 36)) and res.tier_per_block == ["ssd"] * 6
        for s, d in zip(range(1, 7), range(30, 36), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        assert [w for w, _ in threads] == ["now"] and threads[0][1].name.startswith("dtkv-readnow")
        assert res.stages.read_bytes == {"ssd": 6 * REC} and res.stages.read_s["ssd"] > 0
        assert res.stages.chunks == 1
        threads.clear()
        res = store.load(dst, list(range(30, 36)), keys[:6], timeout=None)
        assert res.loaded_block_ids == list(range(30, 36))
        assert threads == [("now", threading.current_thread())]
        threads.clear()
        res = store.load(dst, list(range(40, 52)), keys, timeout=10)  # 12 blocks: more than a slab
        assert res.loaded_block_ids == list(range(40, 52))
        assert threads and all(w == "loop" and t is not threading.current_thread() for w, t in threads)
    _all_slabs_back(pool)


def test_tier_read_parallelism_bounds_reads_in_flight_across_chunks(pool: StagingPool, monkeypatch) -> None:
    ssd = PieceTier("ssd", 64 * REC)
    ssd.read_parallelism = 2  # type: ignore[misc]
    ssd.read_piece_bytes = REC  # type: ignore[attr-defined]  # the tier's own piece size, not MIN_PIECE_BYTES
    store, src, keys = _filled([ssd], pool, 24, load_chunk_bytes=8 * REC, load_first_chunk_bytes=2 * REC)
    with store:
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 54)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(30, 54))
        for s, d in zip(range(1, 25), range(30, 54), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        assert ssd.max_in_flight == 2  # pieces of several chunks, never more than the tier's parallelism
        assert max(ssd.calls) <= 4
    _all_slabs_back(pool)


def test_failed_piece_fails_from_its_first_block_on_and_frees_slabs(pool: StagingPool, monkeypatch) -> None:
    monkeypatch.setattr(sr, "MIN_PIECE_BYTES", REC)
    ssd = PieceTier("ssd", 64 * REC)
    store, _, keys = _filled([ssd], pool, 24, load_chunk_bytes=8 * REC, load_first_chunk_bytes=2 * REC)
    with store:
        ssd.raise_keys = {keys[13]}  # a piece in the middle of the third chunk raises
        res = store.load(make_layout(64), list(range(30, 54)), keys, timeout=10)
        # pieces of that chunk before the failing one are restored, nothing after it
        assert 2 + 8 <= len(res.loaded_block_ids) <= 13
        assert res.loaded_block_ids + res.failed_block_ids == list(range(30, 54))
        ssd.raise_keys, ssd.fail_keys = set(), {keys[5]}  # a missing record inside a piece
        res = store.load(make_layout(64), list(range(30, 54)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(30, 35))
        _all_slabs_back(pool)  # abandoned read-ahead chunks free theirs when their reads end


def test_timeout_with_chunks_in_flight_frees_every_slab_once_reads_end(pool: StagingPool) -> None:
    slow = GatedTier("object", 64 * REC)
    store, _, keys = _filled([slow], pool, 20, load_chunk_bytes=4 * REC, load_first_chunk_bytes=REC)
    with store:
        slow.gate.clear()
        res = store.load(make_layout(64), list(range(30, 50)), keys, timeout=0.2)
        assert res.loaded_block_ids == [] and res.failed_block_ids == list(range(30, 50))
        assert pool.free_count < 6  # readers still hold their slabs
        slow.gate.set()
        _all_slabs_back(pool)


def _all_slabs_back(pool: StagingPool) -> None:
    for _ in range(300):
        if pool.free_count == len(pool.slabs):
            return
        threading.Event().wait(0.01)
    assert pool.free_count == len(pool.slabs)


def test_load_from_a_background_thread_and_not_from_the_loop(pool: StagingPool) -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    store, _src, keys = _filled([host], pool, 6)
    with store:
        dst = make_layout(64)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", store.load(dst, list(range(30, 36)), keys)))
        t.start()
        t.join(10)
        assert out["r"].loaded_block_ids == list(range(30, 36))
        with pytest.raises(RuntimeError):
            asyncio.run_coroutine_threadsafe(_call_load(store, dst, keys), store._loop).result(10)


async def _call_load(store, dst, keys):
    return store.load(dst, [30], keys[:1])


def test_host_records_decode_in_place_including_split_records(pool: StagingPool) -> None:
    # chunk_bytes < record: records span chunks; after churn some are not adjacent and are spilled
    host = HostTier(40 * REC, chunk_bytes=REC // 2, pin=False)
    store, src, keys = _filled([host], pool, 12)
    with store:
        for k in keys[2:10:2]:
            asyncio.run(host.delete(k))
        more = keys_for(4, start=900)
        store.submit_offload(make_layout(64, seed=3), [40, 41, 42, 43], more, parents_of(more))
        store.submit_offload(src, list(range(1, 13)), keys, parents_of(keys))  # fragmented again
        store.drain(10)
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 42)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(30, 42)) and res.tier_per_block == ["host"] * 12
        for s, d in zip(range(1, 13), range(30, 42), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        assert res.stages.read_bytes["host"] == 12 * REC
        assert pool.free_count == 6


def test_pinned_host_record_survives_eviction_until_released() -> None:
    host = HostTier(2 * REC, chunk_bytes=REC, pin=False)
    a, b, c = keys_for(3)
    rec = np.arange(REC, dtype=np.uint8)
    host.write_sync(a, memoryview(rec))
    host.write_sync(b, memoryview(rec[::-1].copy()))
    views, pin = host.pin_records([a], lambda j: np.empty(REC, np.uint8))
    asyncio.run(host.delete(a))  # dropped while a load reads it in place
    host.write_sync(c, memoryview(np.zeros(REC, np.uint8)))  # must not reuse a's pinned chunk: evicts b
    assert not host.contains(a) and not host.contains(b) and host.contains(c)
    assert np.array_equal(views[0], rec)  # not overwritten
    with pytest.raises(TierFull):  # only pinned memory would be left to evict
        host.write_sync(b, memoryview(np.ones(2 * REC, np.uint8)))
    pin.release()
    pin.release()  # idempotent
    host.write_sync(b, memoryview(np.ones(2 * REC, np.uint8)))  # a's chunk is free again
    assert host.usage().num_blocks == 1


def test_host_chunk_leaving_between_plan_and_decode_is_read_from_the_next_tier(pool: StagingPool) -> None:
    host, ssd = HostTier(64 * REC, chunk_bytes=REC, pin=False), NamedHost("ssd", 64 * REC)
    store, src, keys = _filled([host, ssd], pool, 4, load_first_chunk_bytes=4 * REC)
    with store:
        orig = host.pin_records

        def racing(ks, spill):  # the last two records are evicted just before the decode
            for k in ks[2:]:
                asyncio.run(host.delete(k))
            return orig(ks, spill)

        host.pin_records = racing  # type: ignore[method-assign]
        dst = make_layout(64)
        res = store.load(dst, [30, 31, 32, 33], keys, timeout=10)
        assert res.loaded_block_ids == [30, 31, 32, 33]
        assert res.tier_per_block == ["host", "host", "ssd", "ssd"]
        for s, d in zip(range(1, 5), range(30, 34), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        store.drain(10)
        assert pool.free_count == 6


def test_split_and_union_helpers() -> None:
    big = sr.MIN_PIECE_BYTES
    assert _split(0, 10, big, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert _split(3, 4, big, 8) == [(3, 4)]
    assert _split(0, 10, 1024, 8) == [(0, 10)]  # pieces below MIN_PIECE_BYTES are not worth it
    assert len(_split(0, 10, 1024, 8, 2048)) == 5  # a tier's own smallest piece
    assert union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert NS is not None


def test_decode_records_in_place_verifies_each_record() -> None:
    from dynamo_tiered_kv.blocks.codec import decode_records, encode_blocks
    from dynamo_tiered_kv.errors import ChecksumMismatch

    src, dst = make_layout(16, seed=5), make_layout(16)
    keys = keys_for(3)
    buf = np.zeros(3 * REC, np.uint8)
    encode_blocks(src, [1, 2, 3], [NS.digest] * 3, keys, parents_of(keys), buf)
    recs = [buf[i * REC:(i + 1) * REC].copy() for i in (2, 0, 1)]  # not back to back, any order
    recs[1][REC - 200] ^= 0xFF  # damage the payload of the record of block 1
    errs = decode_records(recs, dst, [7, 5, 6], namespace=NS.digest, keys=[keys[2], keys[0], keys[1]])
    assert errs[0] is None and isinstance(errs[1], ChecksumMismatch) and errs[2] is None
    assert block_bytes(dst, 7) == block_bytes(src, 3) and block_bytes(dst, 6) == block_bytes(src, 2)
    assert block_bytes(dst, 5) != block_bytes(src, 1)


def test_object_tier_restores_in_slab_sized_chunks_one_ranged_get_per_run(pool: StagingPool, tmp_path) -> None:
    """A load from the object tier alone is not cut into a small first chunk and small pieces:
    every run of a chunk inside one data object is one ranged GET (the store's default chunks of
    two records and a first chunk of one would cost a request per record or two)."""
    from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier

    class CountingBackend(LocalDirBackend):
        gets = 0

        async def get_range(self, name, offset, dests):
            CountingBackend.gets += 1
            return await super().get_range(name, offset, dests)

    obj = ObjectTier(CountingBackend(tmp_path / "obj"))
    obj.load_chunk_bytes = obj.read_piece_bytes = 8 * REC  # one staging slab
    store, src, keys = _filled([obj], pool, 20, load_chunk_bytes=2 * REC, load_first_chunk_bytes=REC)
    with store:
        assert store.lookup(keys).num_blocks == 20
        res = _load_back(store, src, keys)
        # offloads of 8 + 8 + 4 records made three data objects; chunks of 8, 6 and 6 records
        # read [0, 8) from the first, [8, 14) from the second and [14, 20) across the last two
        assert res.stages.chunks == 3
        assert CountingBackend.gets == 4
    _all_slabs_back(pool)


def test_a_host_restore_is_one_in_place_chunk_up_to_a_slab(pool: StagingPool) -> None:
    """Nothing to overlap in host memory: the store's small first chunk and 2-record chunks are
    not used for it, one chunk per staging slab is (each chunk is a hand-off to the loop and back)."""
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    store, src, keys = _filled([host], pool, 20, load_chunk_bytes=2 * REC, load_first_chunk_bytes=REC)
    with store:
        res = _load_back(store, src, keys)
        assert res.stages.chunks == 3  # 20 records in slabs of 8: 7 + 7 + 6
    _all_slabs_back(pool)
