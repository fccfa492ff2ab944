"""Verify+scatter fanned out over threads (``store.reads.fanout``): order, coverage, errors, and the
store's unpaced loads restoring the same bytes through it."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

import dynamo_tiered_kv.store.reads.fanout as fo
from dynamo_tiered_kv.tiers.host import HostTier
from tests.test_pacing import stored
from tests.test_store import REC, NamedHost, block_bytes, make_layout


@pytest.fixture
def three_ways(monkeypatch):
    monkeypatch.setattr(fo, "WAYS", 3)
    monkeypatch.setattr(fo, "MIN_BYTES_PER_WAY", 1)


def test_ranges_cover_everything_once_in_order_on_several_threads(three_ways) -> None:
    calls: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def decode(a: int, b: int) -> list[int]:
        with lock:
            calls.append((a, b, threading.current_thread().name))
        time.sleep(0.02)
        return list(range(a, b))

    assert fo.fan_out(10, 1, decode) == list(range(10))
    spans = sorted((a, b) for a, b, _ in calls)
    assert spans[0][0] == 0 and spans[-1][1] == 10 and len(spans) == 3
    assert all(x[1] == y[0] for x, y in itertools.pairwise(spans))  # contiguous, disjoint
    names = {t for *_, t in calls}
    assert threading.current_thread().name in names and any(t.startswith("dtkv-decode") for t in names)


def test_small_chunks_stay_on_the_calling_thread(monkeypatch) -> None:
    monkeypatch.setattr(fo, "WAYS", 4)
    monkeypatch.setattr(fo, "MIN_BYTES_PER_WAY", 100)
    seen: list[str] = []
    assert fo.fan_out(3, 50, lambda a, b: seen.append(threading.current_thread().name) or [a, b]) == [0, 3]
    assert seen == [threading.current_thread().name]


def test_an_error_in_one_range_is_raised_after_every_range_ended(three_ways) -> None:
    ended: list[int] = []

    def decode(a: int, b: int) -> list[int]:
        if a == 0:
            raise RuntimeError("broken decode")
        time.sleep(0.05)
        ended.append(a)
        return []

    with pytest.raises(RuntimeError):
        fo.fan_out(9, 1, decode)
    assert len(ended) == 2  # the helpers' ranges finished before fan_out raised


@pytest.mark.parametrize("tier_kind", ["host", "ssd"])
def test_unpaced_load_restores_the_same_bytes_fanned_out(tier_kind: str, three_ways, monkeypatch) -> None:
    names: set[str] = set()
    real = fo.fan_out

    def spy(n, rb, decode, ways=None):
        return real(n, rb, lambda a, b: (names.add(threading.current_thread().name), decode(a, b))[1], ways)

    import dynamo_tiered_kv.store.reads.pipeline as sr

    monkeypatch.setattr(sr, "fan_out", spy)
    tier = HostTier(64 * REC, chunk_bytes=REC, pin=False) if tier_kind == "host" else NamedHost("ssd", 64 * REC)
    store, pool, src, keys = stored(tier, 20, 8)
    with store:
        _, chunks = tier._index[keys[14]]
        tier._chunks[chunks[0], REC - 100] ^= 0xFF  # a bad record in a later range
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 50)), keys, timeout=10)
        assert res.loaded_block_ids == list(range(30, 44)) and res.failed_block_ids == list(range(44, 50))
        for s, d in zip(range(1, 15), range(30, 44), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        assert any(n.startswith("dtkv-decode") for n in names)
    pool.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_threads_bounds_the_ranges_of_an_unpaced_load(threads: int, three_ways, monkeypatch) -> None:
    """``decode_threads=1`` keeps verify+scatter on the caller (a restore on an engine thread whose
    OpenMP workers spin on the other cores); 2 cuts a chunk into at most two ranges, one on a
    helper; the bytes are the same. Without it a chunk takes every way (three here)."""
    calls: list[list[str]] = []
    lock = threading.Lock()
    real = fo.fan_out

    def spy(n, rb, decode, ways=None):
        seen: list[str] = []
        calls.append(seen)

        def named(a, b):
            with lock:
                seen.append(threading.current_thread().name)
            return decode(a, b)
        return real(n, rb, named, ways)

    import dynamo_tiered_kv.store.reads.pipeline as sr

    monkeypatch.setattr(sr, "fan_out", spy)
    tier = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    store, pool, src, keys = stored(tier, 20, 8)
    with store:
        dst = make_layout(64)
        caller = threading.current_thread().name
        res = store.load(dst, list(range(30, 50)), keys, timeout=10, decode_threads=threads)
        assert res.loaded_block_ids == list(range(30, 50))
        for s, d in zip(range(1, 21), range(30, 50), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        if threads == 1:
            assert calls == []  # never fanned out: decoded on the calling thread
        else:
            assert calls and all(len(c) == 2 and caller in c and any(n.startswith("dtkv-decode") for n in c)
                                 for c in calls)
        calls.clear()
        store.load(dst, list(range(30, 50)), keys, timeout=10)  # the store's own choice: every way
        assert calls and all(len(c) == 3 for c in calls)
    pool.close()
