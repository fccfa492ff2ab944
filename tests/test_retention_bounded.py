"""Retention tables stay bounded by the live retained keys, and the SSD tier's victim pick and the
prefetch room cost work for what changed, not one lookup per retained key."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.policy.retention import RetentionClasses
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.testing import random_key
from dynamo_tiered_kv.testing.clock import ManualClock as Clock
from dynamo_tiered_kv.testing.ssd import open_ssd_tier
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.ssd import SSDTier, metrics
from dynamo_tiered_kv.tiers.ssd.index import CompactIndex
from tests.test_store import NS, REC, keys_for, make_layout

CHUNK = 4096
DATA = memoryview(bytes(CHUNK))


def _k(i: int) -> bytes:
    return random_key(i, b"rb")


def _bounded(cls: RetentionClasses) -> bool:
    live = len(cls)
    return all(n <= 2 * live + 1024 + 1 for n in cls.heap_entries)


# --- heaps ------------------------------------------------------------------------------------
def test_heaps_stay_bounded_by_the_live_keys_under_churn() -> None:
    clock = Clock(1_000_000.0)
    cls = RetentionClasses(1 << 40, max_share=1.0, clock=clock, tier="churn-test")
    keys = [_k(i) for i in range(4)]
    holders = [("t", "a"), ("t", "b")]
    for i in range(200_000):
        k = keys[i % 4]
        op = i % 7
        if op == 5:
            cls.release([k], holders[i % 2])
        elif op == 6 and i % 3 == 0:
            cls.forget([k])
        else:  # a new (priority, expiry) each time: every one used to push an entry into both heaps
            cls.set(k, 1 + i % 100, clock.t + 60 + i, CHUNK, holders[i % 2])
        if i % 10_000 == 0:
            assert _bounded(cls), (i, cls.heap_entries, len(cls))
    assert _bounded(cls) and max(cls.heap_entries) <= 1024 + 2 * 4 + 1
    cls.forget(keys)
    assert len(cls) == 0 and max(cls.heap_entries) <= 1024 + 1
    for k in keys:  # the table still works after all that
        assert cls.set(k, 10, clock.t + 5, CHUNK)
    clock.t += 10
    assert sorted(k for k, _ in cls.expired()) == sorted(keys)


def test_setting_the_same_claim_again_pushes_nothing() -> None:
    clock = Clock(1_000_000.0)
    cls = RetentionClasses(1 << 40, max_share=1.0, clock=clock, tier="same-test")
    k = _k(1)
    cls.set(k, 40, clock.t + 3600, CHUNK)
    before = cls.heap_entries
    for _ in range(5000):  # a lookup re-retains the same chunk at the same level every time
        assert cls.set(k, 40, clock.t + 3600, CHUNK)
    assert cls.heap_entries == before == (1, 1)


# --- SSD victim pick --------------------------------------------------------------------------
def _count(m: pytest.MonkeyPatch, counts: collections.Counter[str], owner: type, name: str) -> None:
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        counts[name] += 1
        return orig(*a, **kw)

    m.setattr(owner, name, counted)


async def _fill(t: SSDTier, start: int, records: int) -> None:
    for i in range(start, start + records, 4):
        await t.write_many((_k(i + j), DATA) for j in range(4))


async def _pick_cost(path: Path, retained: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(lookups of retention classes and index entries, segments evicted) while 1 MiB is written
    through a full 400 KiB tier holding 16 retained blocks, with ``retained`` claims in all."""
    clock = Clock(1_000_000.0)
    t = await open_ssd_tier(path, capacity_bytes=400 << 10, segment_bytes=64 << 10, fsync=False)
    try:
        t.configure_retention(max_share=1.0, clock=clock)
        for i in range(16):  # these are written here (retained before they are written)
            t.retention.set(_k(i), 50, None, CHUNK)
        for i in range(retained - 16):  # blocks retained elsewhere (another tier, not written yet)
            t.retention.set(random_key(i, b"elsewhere"), 50, clock.t + 86400, CHUNK)
        await _fill(t, 0, 160)  # past the capacity: the first picks took place
        counts: collections.Counter[str] = collections.Counter()
        evicted = metrics.EVICTED_SEGMENTS._value.get()
        with monkeypatch.context() as m:
            for name in ("priority", "rank", "standing", "get", "items", "retained_keys", "protected"):
                if hasattr(RetentionClasses, name):
                    _count(m, counts, RetentionClasses, name)
            _count(m, counts, CompactIndex, "get")
            await _fill(t, 1000, 256)
        evicted = metrics.EVICTED_SEGMENTS._value.get() - evicted
        assert all(t.contains(_k(i)) for i in range(16))  # protected all along
        return sum(counts.values()), int(evicted)
    finally:
        await t.close()


async def test_ssd_victim_pick_costs_do_not_grow_with_retained_keys(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    small, picks_small = await _pick_cost(tmp_path / "small", 1_000, monkeypatch)
    large, picks_large = await _pick_cost(tmp_path / "large", 20_000, monkeypatch)
    assert picks_small == picks_large >= 10
    # one full scan of the claims per pick would be >= 20,000 lookups per pick here
    assert large <= small + 16 and large <= 8 * picks_large, (small, large, picks_large)


@pytest.mark.parametrize("event", ["lapsed", "released", "deleted", "moved", "retained_late"])
async def test_ssd_segment_ranks_follow_time_and_changes(tmp_path: Path, event: str) -> None:
    """Five sealed segments of four blocks fill the tier; each new one evicts one. The segment
    holding block ``k`` is ranked once (a pick), then ``event`` changes its rank."""
    clock = Clock(1_000_000.0)
    t = await open_ssd_tier(tmp_path, capacity_bytes=100 << 10, segment_bytes=64 << 10, fsync=False)
    t.configure_retention(max_share=1.0, clock=clock)
    k = _k(999)
    k_seg = 3 if event == "lapsed" else 2  # "lapsed": an older ordinary segment must stay behind it
    segs: dict[int, list[bytes]] = {}
    try:
        if event != "retained_late":
            t.retention.set(k, 50, clock.t + 10 if event == "lapsed" else None, CHUNK)

        async def segment(n: int, keys: list[bytes]) -> None:
            segs[n] = keys
            await t.write_many((key, DATA) for key in keys)
            await t.seal()

        for n in range(1, 6):
            await segment(n, ([k] if n == k_seg else []) + [_k(10 * n + j) for j in range(4 - (n == k_seg))])
        await segment(6, [_k(60 + j) for j in range(4)])  # one pick: segment 1 goes, ranks are known
        assert not t.contains(segs[1][-1]) and t.contains(k)

        def kept(n: int) -> bool:
            return t.contains(segs[n][-1])

        if event == "lapsed":
            clock.t += 20  # k's claim lapsed: its segment goes before the older ordinary one
            await segment(7, [_k(70 + j) for j in range(4)])
            assert kept(2) and not kept(3)
        elif event in ("released", "deleted"):
            if event == "released":
                t.retention.release([k])
            else:
                assert await t.delete(k)
            await segment(7, [_k(70 + j) for j in range(4)])
            assert not kept(2) and kept(3)  # no longer protected: the oldest goes
        elif event == "retained_late":
            t.retention.set(k, 50, None, CHUNK)
            await segment(7, [_k(70 + j) for j in range(4)])
            assert kept(2) and not kept(3)
        else:  # a newer copy of k: its old segment holds nothing retained any more
            await segment(7, [k] + [_k(70 + j) for j in range(3)])  # picked before k moved: 3 went
            assert kept(2) and not kept(3)
            await segment(8, [_k(80 + j) for j in range(4)])
            assert not kept(2) and kept(4) and t.contains(k)
    finally:
        await t.close()


# --- prefetch room ----------------------------------------------------------------------------
@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def _prefetch_cost(tmp_path: Path, pool: StagingPool, retained: int,
                   monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    tiers = [HostTier(32 * REC, chunk_bytes=REC, pin=False),
             SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, segment_bytes=64 << 10, idle_seal_s=None)]
    with TieredStore(tiers, NS, pool, write_depth=2, retain_max_share=1.0) as store:
        keys = keys_for(6)
        assert store.submit_offload(make_layout(7, seed=5), list(range(1, 7)), keys, parents_of(keys))
        assert store.drain(20)
        assert store.demote(keys) == 6  # down to the SSD tier: prefetch brings them back
        host = store.retention.retention_of(0)
        for i in range(retained):  # retained blocks that live elsewhere, retained with no bytes
            host.set(random_key(i, b"far"), 50, None, 0)
        counts: collections.Counter[str] = collections.Counter()
        with monkeypatch.context() as m:
            for name in ("priority", "rank", "standing", "get", "items", "retained_keys", "protected"):
                if hasattr(RetentionClasses, name):
                    _count(m, counts, RetentionClasses, name)
            got = store.prefetch_now(keys)
        assert all(tiers[0].contains(k) for k in keys)
        return sum(counts.values()), got


def test_prefetch_room_costs_do_not_grow_with_retained_keys(tmp_path: Path, pool: StagingPool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    small, got_small = _prefetch_cost(tmp_path / "small", pool, 1_000, monkeypatch)
    large, got_large = _prefetch_cost(tmp_path / "large", pool, 20_000, monkeypatch)
    assert got_small == got_large == 6
    assert large == small and large <= 64, (small, large)
