"""A restore of one chunk from a tier that reads without the store's loop: on a helper thread the
caller waits for until its deadline (on the caller when it has none), in two parts when large
enough, the second read while the first is verified; the slab is freed whoever finishes last."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import dynamo_tiered_kv.store.reads.direct as sdr
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.tiers.ssd import SSDTier
from tests.test_store import REC, block_bytes, make_layout
from tests.test_store_pipeline import _all_slabs_back, _filled


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 6, pin=False)
    yield p
    p.close()


def _spied(ssd: SSDTier, gate: threading.Event | None = None, gated: int | None = None) -> list[tuple[str, int, str]]:
    """Record ("start"/"end", records, thread name) around each ``read_slab_now``; a helper's read
    (of ``gated`` records, if given) waits for ``gate``."""
    calls: list[tuple[str, int, str]] = []
    real = ssd.read_slab_now

    def spy(keys, dest, rb):
        name = threading.current_thread().name
        calls.append(("start", len(keys), name))
        if gate is not None and name.startswith("dtkv-readnow") and gated in (None, len(keys)):
            gate.wait(10)
        try:
            return real(keys, dest, rb)
        finally:
            calls.append(("end", len(keys), name))

    ssd.read_slab_now = spy  # type: ignore[method-assign]
    return calls


@pytest.fixture
def ssd(tmp_path, monkeypatch) -> SSDTier:
    monkeypatch.setattr(sdr, "SPLIT_MIN_BYTES", 4 * REC)  # tiny test records: split from 4 on
    return SSDTier(tmp_path / "ssd", capacity_bytes=64 * REC, segment_bytes=64 * REC, io="odirect")


def test_first_part_sizes() -> None:
    rb = 1 << 20
    assert sdr.first_part(7, rb) == 7  # 7 MiB: one read
    assert sdr.first_part(8, rb) == 6
    assert sdr.first_part(15, rb) == 11  # a 2k-token prefix at 8 KiB/token
    assert sdr.first_part(1, 64 << 20) == 1
    assert sdr.first_part(2, 8 << 20) == 1


def test_large_direct_load_reads_its_rest_on_a_helper_while_the_first_part_is_verified(pool, ssd) -> None:
    store, src, keys = _filled([ssd], pool, 8, load_chunk_bytes=4 * REC, load_first_chunk_bytes=REC)
    calls = _spied(ssd)
    with store:
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 38)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(30, 38)) and res.tier_per_block == ["ssd"] * 8
        for s, d in zip(range(1, 9), range(30, 38), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        # a load with a deadline reads both parts on helpers, the second once the first returned
        assert [(e, n) for e, n, _ in calls] == [("start", 6), ("end", 6), ("start", 2), ("end", 2)]
        assert all(t.startswith("dtkv-readnow") for _, _, t in calls)
        assert res.stages.chunks == 2 and res.stages.read_bytes == {"ssd": 8 * REC}
        assert store.metrics.value("restore_bytes_total", tier="ssd") == 8 * REC
        calls.clear()
        res = store.load(dst, list(range(40, 43)), keys[:3], timeout=10)  # below the split size
        assert res.loaded_block_ids == list(range(40, 43))
        assert [(e, n) for e, n, _ in calls] == [("start", 3), ("end", 3)] and calls[0][2].startswith("dtkv-readnow")
    _all_slabs_back(pool)


def test_a_direct_load_without_a_deadline_reads_its_first_part_on_the_calling_thread(pool, ssd) -> None:
    """Nothing to bound: no hand-off for the first part; the rest still on a helper."""
    store, src, keys = _filled([ssd], pool, 8, load_chunk_bytes=4 * REC, load_first_chunk_bytes=REC)
    calls = _spied(ssd)
    with store:
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 38)), keys, timeout=None)
        assert res.loaded_block_ids == list(range(30, 38))
        for s, d in zip(range(1, 9), range(30, 38), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        caller = threading.current_thread().name
        assert [(e, n, t == caller) for e, n, t in calls] == [("start", 6, True), ("end", 6, True),
                                                             ("start", 2, False), ("end", 2, False)]
        assert calls[2][2].startswith("dtkv-readnow")
    _all_slabs_back(pool)


@pytest.mark.parametrize("bad", [2, 7])  # a record of the first part, of the second
def test_a_corrupt_record_fails_from_there_on_in_either_part(pool, ssd, bad: int) -> None:
    store, src, keys = _filled([ssd], pool, 8, load_chunk_bytes=4 * REC, load_first_chunk_bytes=REC)
    with store:
        path, off, _ = ssd.location(keys[bad])
        with open(path, "r+b") as f:
            f.seek(off + REC - 64)
            b = f.read(1)
            f.seek(off + REC - 64)
            f.write(bytes([b[0] ^ 0x01]))
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 38)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(30, 30 + bad))
        assert res.failed_block_ids == list(range(30 + bad, 38))
        for s, d in zip(range(1, bad + 1), range(30, 30 + bad), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
    _all_slabs_back(pool)


def test_timeout_while_the_helper_reads_frees_its_slab_when_the_read_returns(pool, ssd) -> None:
    store, _, keys = _filled([ssd], pool, 8, load_chunk_bytes=4 * REC, load_first_chunk_bytes=REC)
    gate = threading.Event()
    _spied(ssd, gate, gated=2)  # the second part's read
    with store:
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 38)), keys, timeout=1.0)  # the first part must arrive by then
        assert res.loaded_block_ids == list(range(30, 36)) and res.failed_block_ids == [36, 37]
        assert pool.free_count < len(pool.slabs)  # the helper still reads into its slab
        gate.set()
        _all_slabs_back(pool)
