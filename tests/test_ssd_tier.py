"""SSD tier specifics beyond the conformance suite: index cost, batching, recovery, segment source."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.errors import TierFull
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.testing.ssd import open_ssd_tier
from dynamo_tiered_kv.testing.ssd import read_whole as read
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.ssd import SSDTier
from dynamo_tiered_kv.tiers.ssd.index import CompactIndex
from dynamo_tiered_kv.tiers.ssd.segment import list_segments, read_footer

SHAPE = small_shape(num_layers=2)  # 12 KiB records


def rec(i: int, seed: int = 0) -> tuple[bytes, bytes]:
    k = random_key(i, b"ssd-tier")
    return k, make_record(k, seed * 7919 + i, shape=SHAPE)


async def opened(path: Path, **kw) -> SSDTier:
    return await open_ssd_tier(path, **kw)


# --- index ---------------------------------------------------------------------------------
def test_index_matches_dict_model_and_stays_under_64_bytes_per_block() -> None:
    rng = random.Random(1)
    idx, model = CompactIndex(), {}
    for step in range(60_000):
        k = random_key(rng.randrange(30_000), b"idx")
        if rng.random() < 0.2:
            assert idx.pop(k) == model.pop(k, None)
        else:
            loc = (rng.randrange(1, 1000), rng.randrange(0, 1 << 20) * 4096, rng.randrange(1, 64) * 4096)
            assert idx.put(k, *loc) == model.get(k)
            model[k] = loc
        if step % 10_000 == 0:
            assert len(idx) == len(model)
    assert set(idx.keys()) == set(model)
    assert all(idx.get(k) == v for k, v in model.items())
    big = CompactIndex()
    for i in range(200_000):
        big.put(random_key(i, b"size"), 1, i * 4096, 4096)
    assert big.nbytes() / len(big) <= 64, f"{big.nbytes() / len(big):.1f} bytes per block"


# --- batching --------------------------------------------------------------------------------
async def test_run_is_written_contiguously_and_read_with_one_request(tmp_path: Path) -> None:
    t = await opened(tmp_path)
    pool = StagingPool(1 << 20, 2, pin=False)
    try:
        items = [rec(i) for i in range(8)]
        n = len(items[0][1])
        src, dst = pool.acquire(), pool.acquire()
        for j, (_, v) in enumerate(items):
            src.array[j * n:(j + 1) * n] = np.frombuffer(v, np.uint8)
        before = dict(t.io_stats)
        await t.write_many((k, src.view[j * n:(j + 1) * n]) for j, (k, _) in enumerate(items))
        assert t.io_stats["write_requests"] - before["write_requests"] == 1
        reqs = [ReadRequest(k, dst.view[j * n:(j + 1) * n]) for j, (k, _) in enumerate(items)]
        random.Random(3).shuffle(reqs)  # the tier sorts by location before coalescing
        assert await t.read_many(reqs) == [n] * len(items)
        assert t.io_stats["read_requests"] - before["read_requests"] == 1
        assert bytes(dst.array[:n * len(items)]) == b"".join(v for _, v in items)
    finally:
        await t.close()
        pool.close()


async def test_run_that_does_not_fit_starts_a_new_segment(tmp_path: Path) -> None:
    t = await opened(tmp_path, segment_bytes=128 << 10)  # 9 records of 12 KiB + footer per segment
    try:
        await t.write_many((k, memoryview(v)) for k, v in (rec(i) for i in range(5)))
        run = [rec(100 + i) for i in range(6)]
        await t.write_many((k, memoryview(v)) for k, v in run)
        before = t.io_stats["read_requests"]
        bufs = [bytearray(len(v)) for _, v in run]
        got = await t.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(run, bufs)])
        assert got == [len(run[0][1])] * 6
        assert t.io_stats["read_requests"] - before == 1, "the run was split across segments"
    finally:
        await t.close()


# --- recovery --------------------------------------------------------------------------------
async def test_torn_tail_is_truncated_and_segment_sealed(tmp_path: Path) -> None:
    t = await opened(tmp_path / "live")
    items = [rec(i) for i in range(4)]
    await t.write_many((k, memoryview(v)) for k, v in items)
    crashed = tmp_path / "crashed" / t.rank_dir.name
    crashed.mkdir(parents=True)
    _, seg_path = list_segments(t.rank_dir)[-1]
    shutil.copy(seg_path, crashed)  # the open segment as a crash leaves it: no footer
    await t.close()
    seg_path = crashed / seg_path.name
    torn_key, torn = rec(99)
    with open(seg_path, "ab") as f:
        f.write(torn[: len(torn) // 2])  # a record cut in the middle by the crash
    t2 = await opened(tmp_path / "crashed")
    try:
        for k, v in items:
            assert await read(t2, k) == v
        assert not t2.contains(torn_key)
        fd = os.open(seg_path, os.O_RDONLY)
        try:
            footer = read_footer(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        assert footer is not None and len(footer.entries) == 4
    finally:
        await t2.close()


async def test_deletes_and_overwrites_survive_reopen(tmp_path: Path) -> None:
    t = await opened(tmp_path, segment_bytes=64 << 10)
    k1, v1 = rec(1)
    k2, v2 = rec(2)
    _, v2b = rec(2, seed=5)
    await t.write(k1, memoryview(v1))
    await t.write(k2, memoryview(v2))
    await t.seal()
    await t.write(k2, memoryview(v2b))  # supersedes the sealed copy
    assert await t.delete(k1)
    await t.close()
    t2 = await opened(tmp_path, segment_bytes=64 << 10)
    try:
        assert not t2.contains(k1)
        assert await read(t2, k2) == v2b
        assert await t2.delete(k2)
    finally:
        await t2.close()
    t3 = await opened(tmp_path, segment_bytes=64 << 10)
    try:
        assert not t3.contains(k2), "an older copy of a deleted key came back"
        assert t3.usage().num_blocks == 0
    finally:
        await t3.close()


# --- capacity and the flusher interface -----------------------------------------------------
async def test_flusher_interface_and_unflushed_segments_are_kept(tmp_path: Path) -> None:
    sealed = []
    t = await opened(tmp_path, capacity_bytes=512 << 10, segment_bytes=128 << 10, on_sealed=sealed.append)
    try:
        assert t.unflushed_segments() == []  # a flusher is now attached: unflushed data is kept
        written = []
        with pytest.raises(TierFull):
            for i in range(200):
                k, v = rec(i)
                await t.write(k, memoryview(v))
                written.append((k, v))
        assert sealed and t.usage().used_bytes <= t.usage().capacity_bytes
        for k, v in written:  # nothing was evicted
            assert await read(t, k) == v
        segs = t.unflushed_segments()
        assert [s.segment_id for s in segs] == [s.segment_id for s in sealed]
        first = segs[0]
        assert first.size == first.path.stat().st_size
        with open(first.path, "rb") as f:  # entries locate verifiable records in the file
            e = first.entries[0]
            f.seek(e.offset)
            assert f.read(e.length) == dict(written)[e.key]
        assert t.pin_segment(first.segment_id)
        for s in segs:
            t.mark_flushed(s.segment_id)
        assert t.unflushed_segments() == []
        k, v = rec(500)
        await t.write(k, memoryview(v))  # evicts a flushed segment, never the pinned one
        assert first.path.exists()
        assert any(not s.path.exists() for s in segs[1:])
        t.unpin_segment(first.segment_id)
        assert await read(t, k) == v
    finally:
        await t.close()
    t2 = await opened(tmp_path, capacity_bytes=512 << 10, segment_bytes=128 << 10)
    try:
        ids = {s.segment_id for s in t2.unflushed_segments()}
        assert first.segment_id not in ids, "the flushed marker did not survive a restart"
    finally:
        await t2.close()


async def test_lru_eviction_keeps_recently_read_segment(tmp_path: Path) -> None:
    t = await opened(tmp_path, capacity_bytes=640 << 10, segment_bytes=128 << 10)
    try:
        first = [rec(i) for i in range(9)]
        await t.write_many((k, memoryview(v)) for k, v in first)
        await t.seal()
        for i in range(9, 60):
            k, v = rec(i)
            await t.write(k, memoryview(v))
            assert await read(t, first[0][0]) == first[0][1]  # keep the first segment hot
        assert t.usage().used_bytes <= t.usage().capacity_bytes
        assert all(t.contains(k) for k, _ in first)
        assert not t.contains(rec(9)[0]), "a cold segment should have been evicted"
    finally:
        await t.close()


async def test_idle_segment_is_sealed(tmp_path: Path) -> None:
    t = await opened(tmp_path)
    try:
        k, v = rec(1)
        await t.write(k, memoryview(v))
        assert await t.seal_if_idle(3600) is None
        sealed = await t.seal_if_idle(0)
        assert sealed is not None and [e.key for e in sealed.entries] == [k]
        assert len(list_segments(t.rank_dir)) == 1
        assert await read(t, k) == v
    finally:
        await t.close()


async def test_bad_values_are_rejected(tmp_path: Path) -> None:
    t = await opened(tmp_path)
    try:
        with pytest.raises(ValueError):
            await t.write(random_key(1), memoryview(b"x" * 100))
        with pytest.raises(ValueError):
            await t.write(b"short", memoryview(bytes(4096)))
    finally:
        await t.close()


async def test_verify_reads_turns_corruption_into_a_miss(tmp_path: Path) -> None:
    t = await opened(tmp_path, verify_reads=True, io="buffered")
    try:
        k, v = rec(1)
        await t.write(k, memoryview(v))
        _, path = list_segments(t.rank_dir)[-1]
        with open(path, "r+b") as f:
            f.seek(len(v) - 100)
            f.write(b"\xff")
        assert await read(t, k) is None
        assert not t.contains(k)
    finally:
        await t.close()


async def test_record_that_cannot_fit_raises_without_evicting(tmp_path: Path) -> None:
    t = await opened(tmp_path, capacity_bytes=512 << 10, segment_bytes=128 << 10)
    try:
        items = [rec(i) for i in range(12)]
        await t.write_many((k, memoryview(v)) for k, v in items)
        huge_key = random_key(1, b"huge")
        huge = make_record(huge_key, 1, shape=small_shape(num_layers=140))  # 564 KiB > capacity
        with pytest.raises(TierFull):
            await t.write(huge_key, memoryview(huge))
        assert all(t.contains(k) for k, _ in items), "a write that cannot fit must not evict anything"
    finally:
        await t.close()


async def test_eviction_reads_footer_and_unlinks_without_the_index_lock(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv.tiers.ssd import eviction as tier_mod

    t = await opened(tmp_path, capacity_bytes=1 << 20, segment_bytes=256 << 10)
    held_during_io: list[bool] = []
    real_read_footer = tier_mod.read_footer_at
    real_unlink = Path.unlink

    def lock_held() -> bool:
        free = t._state.lock.acquire(blocking=False)
        if free:
            t._state.lock.release()
        return not free

    def footer_probe(*a, **kw):
        held_during_io.append(lock_held())
        return real_read_footer(*a, **kw)

    def unlink_probe(self: Path, missing_ok: bool = False) -> None:
        if self.parent == t.rank_dir:
            held_during_io.append(lock_held())
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(tier_mod, "read_footer_at", footer_probe)
    monkeypatch.setattr(Path, "unlink", unlink_probe)
    try:
        items = [rec(i) for i in range(200)]  # 2.4 MiB through a 1 MiB budget
        for i in range(0, len(items), 10):
            await t.write_many(items[i:i + 10])
        assert len(held_during_io) >= 2 and not any(held_during_io)
        assert t.usage().used_bytes <= 1 << 20
        newest = items[-1]
        assert await read(t, newest[0]) == newest[1]
    finally:
        monkeypatch.undo()
        await t.close()


async def test_close_waits_for_reads_in_flight_instead_of_closing_their_files(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import threading

    from dynamo_tiered_kv.tiers.ssd import reads as reads_mod

    t = await opened(tmp_path)
    items = [rec(i) for i in range(4)]
    await t.write_many(items)
    await t.seal()
    entered, go = threading.Event(), threading.Event()
    real = reads_mod.read_extent

    def slow_read(*a, **kw):
        entered.set()
        assert go.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(reads_mod, "read_extent", slow_read)
    n = len(items[0][1])
    bufs = [bytearray(n) for _ in items]
    async def close_during_read() -> None:
        assert await asyncio.to_thread(entered.wait, 10)

        async def release_later() -> None:
            await asyncio.sleep(0.2)  # close runs its writer-thread part with the read still parked
            go.set()

        await asyncio.gather(t.close(), release_later())

    got, _ = await asyncio.gather(t.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(items, bufs)]),
                                  close_during_read())
    assert got == [n] * len(items)
    assert [bytes(b) for b in bufs] == [v for _, v in items]
