"""Retention claims per holder: others can only raise a block's class; only the holder that set a
claim lowers or releases it; the tier dropping a block drops every claim."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.hints import BlockRetention
from dynamo_tiered_kv.policy.retention import ANONYMOUS, MAX_HOLDERS_PER_KEY, RetentionClasses
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.testing import random_key
from dynamo_tiered_kv.testing.clock import ManualClock as Clock
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.ssd import SSDTier
from tests.test_store import NS, REC, keys_for, make_layout

CHUNK = 4096
A = ("tenant-a", "session-1")
B = ("tenant-b", "session-9")


def _k(i: int) -> bytes:
    return random_key(i, b"rh")


def _table(clock: Clock) -> RetentionClasses:
    return RetentionClasses(100 * CHUNK, max_share=1.0, clock=clock, tier="holders-test")


def test_another_holders_release_or_weaker_claim_never_lowers_a_claim() -> None:
    clock = Clock(1_000_000.0)
    cls = _table(clock)
    k = _k(1)
    assert cls.set(k, 100, clock.t + 3600, CHUNK, A)
    assert cls.set(k, 0, None, CHUNK, B)  # B's release: B held nothing; A's claim stands
    assert cls.priority(k) == 100
    assert cls.set(k, 1, clock.t + 1, CHUNK, B)  # a short, low claim looking up a shared prefix
    assert cls.priority(k) == 100 and cls.get(k).expiry == clock.t + 3600
    cls.release([k], B)
    assert cls.priority(k) == 100
    clock.t += 10  # B's claim lapsed long ago: nothing expires while A's claim runs
    assert cls.expired() == [] and cls.priority(k) == 100
    cls.release([k])  # ANONYMOUS held nothing either
    assert cls.priority(k) == 100


def test_a_holders_own_release_lowers_the_block_to_the_other_claim() -> None:
    clock = Clock(1_000_000.0)
    cls = _table(clock)
    k = _k(2)
    cls.set(k, 90, clock.t + 60, CHUNK, A)
    cls.set(k, 20, None, CHUNK, B)
    assert cls.get(k).priority == 90
    assert cls.set(k, 0, None, CHUNK, A)  # A lets go: B still protects it
    assert cls.get(k).priority == 20 and cls.get(k).expiry is None
    cls.release([k], B)
    assert k not in cls and cls.priority(k) == 0 and cls.protected_bytes == 0


def test_a_holder_lowers_its_own_claim() -> None:
    clock = Clock(1_000_000.0)
    cls = _table(clock)
    k = _k(3)
    cls.set(k, 90, None, CHUNK, A)
    cls.set(k, 30, clock.t + 60, CHUNK, A)  # the same holder again: replaces its claim
    assert cls.get(k).priority == 30 and cls.holders(k) == {A: (30, clock.t + 60)}


def test_a_lapsed_strong_claim_leaves_the_longer_weaker_one() -> None:
    clock = Clock(1_000_000.0)
    cls = _table(clock)
    k = _k(4)
    cls.set(k, 100, clock.t + 10, CHUNK, A)
    cls.set(k, 5, None, CHUNK, B)
    clock.t += 11
    assert cls.priority(k) == 5 and cls.expired() == []
    assert cls.rank(k, clock.t) == (5, float("inf"))


def test_the_expiry_pass_keeps_a_block_whose_stronger_claim_still_runs(tmp_path: Path) -> None:
    clock = Clock(time.time())
    pool = StagingPool(8 * REC, 4, pin=False)
    tiers = [HostTier(64 * REC, chunk_bytes=REC, pin=False),
             SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, segment_bytes=64 << 10, idle_seal_s=None)]
    try:
        with TieredStore(tiers, NS, pool, write_depth=2, clock=clock) as store:
            keys = keys_for(4)
            store.retain(keys, BlockRetention(100, clock.t + 7200), holder=A)
            store.retain(keys, BlockRetention(1, clock.t + 1), holder=B)  # a shared prefix looked up
            layout = make_layout(5, seed=5)
            assert store.submit_offload(layout, [1, 2, 3, 4], keys, parents_of(keys))
            assert store.drain(20)
            clock.t += 60  # B's claim lapsed, A's runs
            rep = store.expire()
            assert rep.blocks == {"host": 0, "ssd": 0}
            assert all(t.contains(k) for t in store.tiers for k in keys)
            assert [store.retention.retention_of(0).priority(k) for k in keys] == [100] * 4
            clock.t += 7200  # now every claim lapsed
            rep = store.expire()
            assert rep.blocks == {"host": 4, "ssd": 4}
    finally:
        pool.close()


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def test_demote_by_one_holder_keeps_blocks_another_holder_protects(pool: StagingPool, tmp_path: Path) -> None:
    tiers = [HostTier(64 * REC, chunk_bytes=REC, pin=False),
             SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, segment_bytes=64 << 10, idle_seal_s=None)]
    with TieredStore(tiers, NS, pool, write_depth=2) as store:
        keys = keys_for(6)
        shared, own = keys[:3], keys[3:]
        store.retain(keys, BlockRetention(50, None), holder=A)
        store.retain(shared, BlockRetention(40, None), holder=B)  # B's session shares the prefix
        layout = make_layout(7, seed=5)
        assert store.submit_offload(layout, list(range(1, 7)), keys, parents_of(keys))
        assert store.drain(20)
        assert store.demote(keys, holder=A) == 3  # A's session paused: only its own blocks move down
        host = store.tiers[0]
        assert all(host.contains(k) for k in shared) and not any(host.contains(k) for k in own)
        assert [store.retention.retention_of(0).priority(k) for k in keys] == [40] * 3 + [0] * 3
        assert store.demote(shared, holder=B) == 3  # B's too: now nothing protects them
        assert not any(host.contains(k) for k in keys)


def test_holders_per_key_are_bounded_and_the_weakest_goes() -> None:
    clock = Clock(1_000_000.0)
    cls = _table(clock)
    k = _k(5)
    for i in range(MAX_HOLDERS_PER_KEY):
        assert cls.set(k, 10 + i, None, CHUNK, ("t", f"s{i}"))
    assert len(cls.holders(k)) == MAX_HOLDERS_PER_KEY and cls.dropped_claims == 0
    assert cls.set(k, 95, None, CHUNK, ("t", "late"))  # one too many: the weakest (10) goes
    held = cls.holders(k)
    assert len(held) == MAX_HOLDERS_PER_KEY and ("t", "s0") not in held and held[("t", "late")] == (95, None)
    assert cls.dropped_claims == 1 and cls.priority(k) == 95
    assert cls.set(k, 1, None, CHUNK, ("t", "weakest"))  # the newcomer is the weakest: it goes itself
    assert ("t", "weakest") not in cls.holders(k) and cls.dropped_claims == 2 and cls.priority(k) == 95


def test_forget_drops_every_holders_claim() -> None:
    clock = Clock(1_000_000.0)
    cls = _table(clock)
    k = _k(6)
    cls.set(k, 50, None, CHUNK, A)
    cls.set(k, 60, clock.t + 100, CHUNK, B)
    cls.set(k, 70, None, CHUNK)  # ANONYMOUS
    assert set(cls.holders(k)) == {A, B, ANONYMOUS}
    cls.forget([k])
    assert k not in cls and cls.holders(k) == {} and cls.protected_bytes == 0


def test_host_eviction_forgets_every_claim_of_the_block_it_drops() -> None:
    clock = Clock(1_000_000.0)
    host = HostTier(4 * CHUNK, chunk_bytes=CHUNK, pin=False)
    host.configure_retention(max_share=1.0, clock=clock)
    keys = [_k(10 + i) for i in range(4)]
    for k in keys:
        host.write_sync(k, memoryview(bytes(CHUNK)))
    host.retention.set(keys[0], 10, None, CHUNK, A)
    host.retention.set(keys[0], 20, None, CHUNK, B)
    for i, k in enumerate(keys[1:]):
        host.retention.set(k, 50 + i, None, CHUNK, A)
    host.write_sync(_k(99), memoryview(bytes(CHUNK)))  # all protected: the lowest class goes
    assert not host.contains(keys[0]) and keys[0] not in host.retention


def test_set_reports_whether_the_block_stays_protected_after_a_release() -> None:
    clock = Clock(1_000_000.0)
    cls = _table(clock)
    k = _k(7)
    cls.set(k, 50, None, CHUNK, A)
    assert cls.set(k, 0, None, CHUNK, B) is True  # still A's
    assert cls.set(k, 0, None, CHUNK, A) is False
    assert cls.set(k, 30, clock.t - 1, CHUNK, A) is False  # an expiry already past releases too
