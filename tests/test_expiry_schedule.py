"""The store runs its expiry pass itself, every ``expire_interval_s``, on its own loop: a retained
block whose expiry passed leaves every tier although nobody calls ``expire()``. A node's pass
deletes a shared manifest only when the manifest's own record lets it go: other nodes may
hold it for a retention the passing node does not know."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.hints import BlockRetention
from dynamo_tiered_kv.policy.retention import DEFAULT_MAX_SHARE
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.testing import make_record, random_key
from dynamo_tiered_kv.testing.clock import ManualClock as Clock
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.expiry import expire_pass
from dynamo_tiered_kv.tiers.ssd import SSDTier
from tests.test_store import NS, REC, keys_for
from tests.test_store_retain_api import _offload

pytestmark = pytest.mark.usefixtures("no_dtkv_env")


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def _until(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``cond`` (the pass runs on the store's loop); generous bound for a loaded 2-core box."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_a_retained_block_expires_in_every_tier_without_a_call_to_expire(pool: StagingPool, tmp_path: Path) -> None:
    clock = Clock()
    tiers = [HostTier(64 * REC, chunk_bytes=REC, pin=False),
             SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, segment_bytes=64 << 10, idle_seal_s=None),
             ObjectTier(LocalDirBackend(tmp_path / "obj"), capacity_bytes=1 << 30, ttl_s=86400.0)]
    loop_threads: set[str] = set()
    with TieredStore(tiers, NS, pool, write_depth=3, clock=clock, expire_interval_s=0.1) as store:
        real = store.retention.expire_pass

        async def watched(now, max_bytes):  # type: ignore[no-untyped-def]
            loop_threads.add(threading.current_thread().name)
            return await real(now, max_bytes)

        store.retention.expire_pass = watched  # type: ignore[method-assign]
        keys, other = keys_for(6), keys_for(4, start=999 * 16)
        store.retain(keys, BlockRetention(50, clock.t + 7200))
        _offload(store, keys)
        _offload(store, other)
        passes = store.retention.expire_passes
        assert _until(lambda: store.retention.expire_passes >= passes + 2)  # passes ran: nothing had expired
        assert all(t.contains(k) for t in store.tiers for k in keys)
        clock.t += 7201  # two simulated hours later; nobody calls expire()
        assert _until(lambda: not any(t.contains(k) for t in store.tiers for k in keys)), \
            [(t.name, sum(t.contains(k) for k in keys)) for t in store.tiers]
        for t in store.tiers:
            assert all(t.contains(k) for k in other), t.name  # never retained: untouched
    assert loop_threads == {"dtkv-store"}  # the store's loop, never an engine thread


def test_interval_zero_turns_the_pass_off_and_a_negative_one_is_refused(pool: StagingPool) -> None:
    clock = Clock()
    host = HostTier(16 * REC, chunk_bytes=REC, pin=False)
    with TieredStore([host], NS, pool, clock=clock, expire_interval_s=0) as store:
        assert "dtkv-expire" not in {t.get_name() for t in store._state.bg_tasks}
        keys = keys_for(2)
        store.retain(keys, BlockRetention(50, clock.t + 60))
        _offload(store, keys)
        clock.t += 61
        assert all(host.contains(k) for k in keys)  # left for an explicit pass
        assert store.expire().blocks == {"host": 2}
        assert store.retention.expire_passes == 0
    with pytest.raises(ValueError, match="expire_interval_s"):
        TieredStore([HostTier(16 * REC, chunk_bytes=REC, pin=False)], NS, pool, expire_interval_s=-1)


def test_the_setting_reaches_the_store_built_from_config(tmp_path: Path) -> None:
    assert TieredKVConfig().expire_interval_s == 300.0
    cfg = TieredKVConfig.from_mapping({"host_capacity_bytes": 1 << 20, "staging_slab_bytes": 1 << 20,
                                       "staging_slabs": 2, "expire_interval_s": 0.1})
    store = build_store(cfg, NS)
    try:
        keys = keys_for(3)
        store.retain(keys, BlockRetention(50, time.time() + 1.0))  # the real clock: one second
        _offload(store, keys)
        host = store.tiers[0]
        assert all(host.contains(k) for k in keys)
        assert _until(lambda: not any(host.contains(k) for k in keys))
        assert store.retention.expire_passes >= 1
    finally:
        store.close()


# --- shared manifests: a node's pass deletes only what the bucket's own record lets go ---------
class _At:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _object_node(root: Path, clock: _At, ttl_s: float = 86400.0) -> ObjectTier:
    tier = ObjectTier(LocalDirBackend(root), ttl_s=ttl_s, refresh_interval_s=None)
    tier.configure_retention(max_share=DEFAULT_MAX_SHARE, clock=clock)
    await tier.open()
    assert await tier.wait_ready(30)
    return tier


@pytest.mark.parametrize("why", ["own_retention_expired", "past_ttl_released_here"])
async def test_a_nodes_pass_keeps_a_manifest_whose_record_still_retains_its_blocks(tmp_path: Path, why: str) -> None:
    t0 = time.time()
    keys = [random_key(i, b"shared") for i in range(2)]
    recs = [make_record(k, i) for i, k in enumerate(keys)]
    long_until = t0 + 5 * 86400
    # Node X retains the blocks for five days and publishes them: the manifest records it.
    x = await _object_node(tmp_path, _At(t0))
    for k, r in zip(keys, recs):
        x.retention.set(k, 70, long_until, len(r))
    await x.write_many(zip(keys, map(memoryview, recs)))
    await x.close()
    (manifest,) = (tmp_path / "manifests").iterdir()

    # Node Y knows a retention of its own: a one-minute hint (its local class wins over the
    # manifest's), or it released the blocks; its pass runs past that, or past its short TTL.
    y_clock = _At(t0)
    y = ObjectTier(LocalDirBackend(tmp_path), ttl_s=86400.0 if why == "own_retention_expired" else 10.0,
                   refresh_interval_s=None)
    y.configure_retention(max_share=DEFAULT_MAX_SHARE, clock=y_clock)
    for k, r in zip(keys, recs):
        y.retention.set(k, 40, t0 + 60, len(r))
    await y.open()
    assert await y.wait_ready(30) and all(y.contains(k) for k in keys)
    if why == "past_ttl_released_here":
        y.retention.release(keys)
    y_clock.t = t0 + 120
    rep = await expire_pass(y)
    await y.close()  # waits for the pass's deletes
    assert rep.blocks + rep.manifests >= 1  # the pass did drop them on node Y
    assert manifest.exists()  # the bucket's record says five days: node Y's pass left it

    # A fresh node finds the blocks and their retention; once the record's retention is over, the
    # same rule lets the manifest go.
    z_clock = _At(t0 + 120)
    z = await _object_node(tmp_path, z_clock)
    assert all(z.contains(k) for k in keys)
    assert [z.retention.priority(k) for k in keys] == [70, 70]
    z_clock.t = long_until + 1
    rep = await expire_pass(z)
    assert rep.blocks == 2 and rep.manifests == 1
    await z.close()
    assert not manifest.exists()
