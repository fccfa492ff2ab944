"""Shared structures under several threads at once: each test hammers one structure's public
methods from a few threads for about a second and checks its invariants (no timing asserted)."""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import dynamo_tiered_kv.store.reads.helper_pools as pools
from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.policy.admission import Admission, Retention
from dynamo_tiered_kv.policy.pacing import StepShare
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.tiers.host import HostTier
from tests.test_store import NS, REC, keys_for, make_layout

SECONDS = 1.0


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    """Let the interpreter switch threads every few bytecodes: races show up in a second."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def hammer(*workers: Callable[[int], None], seconds: float = SECONDS) -> None:
    """Run each ``worker(i)`` in a loop (i counts its calls) on its own thread; re-raise the first error."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop(w: Callable[[int], None]) -> None:
        i = 0
        try:
            while not stop.is_set():
                w(i)
                i += 1
        except BaseException as e:  # reported to the test below
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def test_admission_counts_every_sighting() -> None:
    adm = Admission("second_hit", memory=1 << 16)
    keys = [_key(i) for i in range(32)]
    done = [0] * 4

    def sight(t: int) -> Callable[[int], None]:
        def w(i: int) -> None:
            assert adm.sight(keys[i % len(keys)]) >= 1
            done[t] += 1
        return w

    hammer(*(sight(t) for t in range(4)))
    counts = [adm.sight(k) - 1 for k in keys]  # one more sighting reads each count
    assert sum(counts) == sum(done)  # no sighting lost between threads
    assert len(adm) == len(keys)


def test_admission_memory_stays_bounded() -> None:
    adm = Admission("second_hit", memory=64)
    hammer(*(lambda i, t=t: adm.sight(_key(t * 10**9 + i)) for t in range(3)))
    assert len(adm) == 64


def test_retention_touch_forget_expire_and_prune() -> None:
    """Loop thread touches and sweeps, writer threads report evictions, a tier holding few keys."""
    held: set[bytes] = set()
    held_lock = threading.Lock()

    def holds(k: bytes) -> bool:
        with held_lock:
            return k in held

    class SmallSlack(Retention):  # before construction: the first pruning limit is set from it
        PRUNE_SLACK = 8

    r = SmallSlack(0.05, holds, lambda: 16)
    expired: list[bytes] = []

    def touch(i: int) -> None:
        k = _key(i)
        with held_lock:
            held.add(k)
            if len(held) > 16:
                held.pop()  # the tier evicts without telling (pruning finds it)
        r.touch(k, time.monotonic())

    def forget(i: int) -> None:
        r.forget([_key(j) for j in range(max(0, i - 4), i)])

    def sweep(i: int) -> None:
        expired.extend(r.expired(time.monotonic()))

    hammer(touch, forget, sweep)
    assert len(r) <= 2 * 16 + 8 + 1
    assert len(expired) == len(set(expired))  # a key expires once
    assert r.expired(time.monotonic() + 1.0) is not None and len(r) == 0


def test_staging_slab_has_one_holder_at_a_time() -> None:
    pool = StagingPool(4096, 3, pin=False)
    holders: dict[int, int] = {}
    check = threading.Lock()

    def use(t: int) -> Callable[[int], None]:
        def w(i: int) -> None:
            slab = pool.try_acquire(0.01)
            if slab is None:
                return
            with check:
                assert slab.index not in holders, "slab handed to two holders"
                holders[slab.index] = t
            slab.array[:8] = t  # the holder's own bytes
            assert int(slab.array[7]) == t
            with check:
                del holders[slab.index]
            pool.release(slab)
        return w

    try:
        hammer(*(use(t) for t in range(5)))
        assert pool.free_count == 3 and not holders
    finally:
        pool.close()


def test_step_share_under_an_engine_and_several_restores() -> None:
    p = StepShare(0.5, stall_s=0.002, first_step_s=0.001)
    seen_waited: list[float] = []
    longest = [0.0]
    last = [time.monotonic()]

    def step(i: int) -> None:
        now = time.monotonic()
        longest[0] = max(longest[0], now - last[0])
        last[0] = now
        p.step(busy=i % 7 != 0)
        time.sleep(0.001)

    def restore(i: int) -> None:
        p.admit(time.monotonic() + 0.01)
        p.spent(0.0002)
        if p.limiting() is not None:
            seen_waited.append(p.waited_s)

    hammer(step, restore, restore, restore)
    assert seen_waited and min(seen_waited) >= 0.0
    # credit is granted per step (at most share x the longest step) and only spent below that
    assert p._credit <= 0.5 * (longest[0] + time.monotonic() - last[0])
    p.step(busy=False)
    p.admit(None)  # an idle engine never holds a slice back


def _record(k: bytes, n: int = 3 * 1024) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(k, digest_size=64).digest() * (n // 64), np.uint8)


def test_host_tier_reads_pins_writes_and_deletes() -> None:
    tier = HostTier(24 * 1024, chunk_bytes=1024, pin=False)  # 8 records of 3 chunks: evicts constantly
    keys = [_key(i) for i in range(20)]
    rb = 3 * 1024

    def write(i: int) -> None:
        k = keys[i % len(keys)]
        tier.write_sync(k, memoryview(_record(k)))

    def read(i: int) -> None:
        k = keys[(i * 7) % len(keys)]
        out = np.empty(rb, np.uint8)
        n = tier.read_sync(k, memoryview(out))
        assert n is None or (n == rb and np.array_equal(out, _record(k)))

    def pin(i: int) -> None:
        ks = [keys[(i + j) % len(keys)] for j in range(3)]
        spill = np.empty((3, rb), np.uint8)
        views, p = tier.pin_records(ks, lambda j: spill[j])
        try:
            for k, v in zip(ks, views):  # pinned: evictions meanwhile must not reuse these bytes
                assert np.array_equal(v, _record(k))
        finally:
            p.release()

    def delete(i: int) -> None:
        if i % 5 == 0:
            import asyncio

            asyncio.run(tier.delete(keys[(i * 3) % len(keys)]))

    hammer(write, write, read, pin, delete)
    u = tier.usage()
    with tier._lock:
        in_index = [c for _, chunks in tier._index.values() for c in chunks]
        assert not tier._pins and not tier._unfreed  # every pin released
        assert u.used_bytes == sum(n for n, _ in tier._index.values())
        assert sorted(in_index + tier._free) == list(range(24))  # every chunk once: free or one record's


def test_helper_pools_created_once(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[object] = []
    real = pools.ThreadPoolExecutor

    def slow_pool(*a, **kw):
        time.sleep(0.01)  # widen the window between the check and the assignment
        made.append(object())
        return real(*a, **kw)

    monkeypatch.setattr(pools, "_pools", {})
    monkeypatch.setattr(pools, "ThreadPoolExecutor", slow_pool)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(pools.helper_pool("dtkv-test", 2))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert len(made) == 1 and len({id(g) for g in got}) == 1
        assert pools.helper_pool("dtkv-other", 1) is not got[0] and len(made) == 2  # one pool per name
    finally:
        for p in pools._pools.values():
            p.shutdown()


def test_residency_hooks_replaced_while_tiers_evict() -> None:
    """``set_residency`` from another thread while the loop's writes evict: retention stays bounded."""
    class Listener:
        def __init__(self) -> None:
            self.removed_n = 0

        def stored(self, medium, keys) -> None:
            pass

        def removed(self, medium, keys) -> None:
            self.removed_n += len(keys)

    pool = StagingPool(8 * REC, 4, pin=False)
    host = HostTier(16 * REC, chunk_bytes=REC, pin=False)
    store = TieredStore([host], NS, pool, ttl_s=[3600.0], sweep_interval_s=3600)
    layout = make_layout(9, seed=2)
    listeners = [Listener(), None]
    try:
        def offload(i: int) -> None:
            keys = keys_for(8, start=i * 8 * 16)
            if store.submit_offload(layout, list(range(1, 9)), keys, parents_of(keys)):
                store.drain(10)

        def swap(i: int) -> None:
            store.set_residency(listeners[i % 2])  # type: ignore[arg-type]

        hammer(offload, swap)
        assert store.drain(10)
        assert store.writer.bookkeeping()["retention_host"] <= host.usage().num_blocks
    finally:
        store.close()
        pool.close()
