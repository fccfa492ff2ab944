"""Retention classes in every tier: protected blocks outlast recency, expired ones go first, the
protected share is bounded, and the object tier keeps per-block expiry in its manifests."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from dynamo_tiered_kv.policy.retention import YIELDED, RetentionClasses
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.expiry import expire_pass
from dynamo_tiered_kv.tiers.objectstore.gc import gc_objects
from dynamo_tiered_kv.tiers.objectstore.manifest import Manifest

CHUNK = 4096


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _host(blocks: int, clock: Clock, share: float = 0.5) -> HostTier:
    host = HostTier(blocks * CHUNK, chunk_bytes=CHUNK, pin=False)
    host.configure_retention(max_share=share, clock=clock)
    return host


def _k(i: int) -> bytes:
    return random_key(i, b"rc")


def _fill(host: HostTier, keys: list[bytes]) -> None:
    for k in keys:
        host.write_sync(k, memoryview(bytes(CHUNK)))


def test_host_evicts_unprotected_before_protected_even_when_older() -> None:
    clock = Clock()
    host = _host(8, clock)
    old = [_k(i) for i in range(4)]
    _fill(host, old)
    for k in old:  # the oldest blocks are the protected ones
        assert host.retention.set(k, 50, clock.t + 3600, CHUNK)
    _fill(host, [_k(100 + i) for i in range(20)])  # plain LRU would evict the oldest first
    assert all(host.contains(k) for k in old)


def test_host_takes_expired_blocks_first_then_lowest_priority() -> None:
    clock = Clock()
    host = _host(4, clock, share=1.0)
    a, b, c, d = (_k(i) for i in range(4))
    _fill(host, [a, b, c, d])
    host.retention.set(a, 90, clock.t + 100, CHUNK)
    host.retention.set(b, 10, None, CHUNK)
    host.retention.set(c, 90, clock.t + 10, CHUNK)
    host.retention.set(d, 90, None, CHUNK)
    clock.t += 50  # c's retention lapsed: it goes before every protected block
    host.retention.set(_k(10), 50, None, CHUNK)  # retained before it is written
    _fill(host, [_k(10)])
    assert not host.contains(c) and all(host.contains(k) for k in (a, b, d))
    _fill(host, [_k(11)])  # only protected blocks left: the lowest priority yields
    assert not host.contains(b) and host.contains(a) and host.contains(d)


def test_protected_share_is_bounded_and_yields_are_counted() -> None:
    clock = Clock()
    cls = RetentionClasses(10 * CHUNK, max_share=0.5, clock=clock, tier="bound-test")
    before = YIELDED.labels("bound-test")._value.get()
    kept = [cls.set(_k(i), 50 - i, None, CHUNK) for i in range(8)]
    assert cls.protected_bytes <= 5 * CHUNK
    assert kept[:5] == [True] * 5 and kept[5:] == [False] * 3  # lower priorities than the first five
    assert cls.yielded == 3 and YIELDED.labels("bound-test")._value.get() - before == 3
    assert cls.set(_k(99), 100, None, CHUNK)  # a higher priority displaces the lowest
    assert not cls.protected(_k(4)) and cls.protected(_k(0))


def test_priority_zero_releases() -> None:
    clock = Clock()
    cls = RetentionClasses(10 * CHUNK, clock=clock)
    cls.set(_k(1), 40, None, CHUNK)
    assert cls.protected(_k(1))
    assert not cls.set(_k(1), 0, None, CHUNK)
    assert not cls.protected(_k(1)) and cls.protected_bytes == 0


# --- object tier -------------------------------------------------------------------------------
def _recs(base: int, n: int) -> list[tuple[bytes, bytes]]:
    shape = small_shape(num_layers=2)
    return [(random_key(base + i, b"ob"), make_record(random_key(base + i, b"ob"), base + i, shape=shape))
            for i in range(n)]


async def _tier(root: Path, clock: Clock, capacity: int = 1 << 40, ttl_s: float | None = 3600.0) -> ObjectTier:
    tier = ObjectTier(LocalDirBackend(root), capacity_bytes=capacity, ttl_s=ttl_s)
    tier.configure_retention(max_share=0.5, clock=clock)
    await tier.open()
    await tier.wait_ready()
    return tier


async def test_object_capacity_eviction_spares_protected_objects(tmp_path: Path) -> None:
    clock = Clock(time.time())
    recs = [_recs(10 * i, 2) for i in range(4)]
    size = sum(len(v) for _, v in recs[0])
    tier = await _tier(tmp_path, clock, capacity=3 * size)
    tier.retention.set(recs[0][0][0], 60, None, len(recs[0][0][1]))  # the oldest object holds it
    for batch in recs:
        await tier.write_many((k, memoryview(v)) for k, v in batch)
        time.sleep(0.002)
    assert tier.contains(recs[0][0][0])  # oldest, but protected
    assert not tier.contains(recs[1][0][0])  # the oldest unprotected one went instead
    await tier.close()


async def test_object_retention_survives_a_new_process_and_extends_gc_ttl(tmp_path: Path) -> None:
    clock = Clock(time.time())
    tier = await _tier(tmp_path, clock, ttl_s=10.0)
    kept, plain = _recs(0, 2), _recs(50, 2)
    for k, v in kept:
        tier.retention.set(k, 70, clock.t + 5 * 86400, len(v))
    await tier.write_many((k, memoryview(v)) for k, v in kept)
    await tier.write_many((k, memoryview(v)) for k, v in plain)
    await tier.close()
    raws = [json.loads((tmp_path / "manifests" / p.name).read_bytes())["body"]
            for p in (tmp_path / "manifests").iterdir()]
    assert sorted("retain" in b for b in raws) == [False, True]  # optional: absent when nothing retained
    parsed = [Manifest.from_bytes(p.read_bytes()) for p in (tmp_path / "manifests").iterdir()]
    assert sorted(len(m.retain) for m in parsed) == [0, 2]

    other = await _tier(tmp_path, Clock(time.time()), ttl_s=10.0)  # another process
    assert [other.retention.priority(k) for k, _ in kept] == [70, 70]
    assert other.retention.get(kept[0][0]).expiry == pytest.approx(clock.t + 5 * 86400)
    await other.close()
    # a day later: past the 10 s TTL, inside the hint's 5 days
    rep = await gc_objects(LocalDirBackend(tmp_path), ttl_s=10.0, grace_s=0, now=clock.t + 86400)
    assert rep.expired_manifests == 1
    later = await _tier(tmp_path, Clock(clock.t + 86400), ttl_s=10.0)
    assert all(later.contains(k) for k, _ in kept)
    await later.close()


async def test_object_expire_pass_drops_expired_blocks_and_their_manifest(tmp_path: Path) -> None:
    clock = Clock(time.time())
    tier = await _tier(tmp_path, clock)
    recs = _recs(0, 3)
    for k, v in recs:
        tier.retention.set(k, 30, clock.t + 60, len(v))
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    rep = await expire_pass(tier)
    assert rep.bytes == 0 and all(tier.contains(k) for k, _ in recs)
    clock.t += 61
    rep = await expire_pass(tier)
    assert rep.blocks == 3 and rep.bytes == sum(len(v) for _, v in recs) and rep.manifests == 1
    assert tier.usage().used_bytes == 0 and not any(tier.contains(k) for k, _ in recs)
    await tier.close()
    assert not list((tmp_path / "manifests").iterdir())


async def test_object_retention_survives_a_process_that_starts_from_the_index_snapshot(tmp_path: Path) -> None:
    """A process that loads the namespace's index snapshot does not read the manifests older than
    it, which carried the retention classes: the snapshot carries them instead."""
    clock = Clock(time.time())
    tier = await _tier(tmp_path, clock)
    kept, plain = _recs(0, 2), _recs(50, 2)
    for k, v in kept:
        tier.retention.set(k, 70, clock.t + 5 * 86400, len(v))
    tier.retention.set(plain[0][0], 40, None, len(plain[0][1]))
    await tier.write_many((k, memoryview(v)) for k, v in kept + plain)
    tier.retention.release([plain[0][0]])  # released after it was published: not carried on
    assert await tier.write_snapshot()
    await tier.close()
    for p in (tmp_path / "manifests").iterdir():  # only the snapshot can tell now
        m = Manifest.from_bytes(p.read_bytes())
        assert m.retain
        p.write_bytes(dataclasses.replace(m, retain=()).to_bytes())

    other = await _tier(tmp_path, Clock(time.time()))
    assert other.stats.snapshot_loads == 1
    assert [other.retention.priority(k) for k, _ in kept] == [70, 70]
    assert other.retention.get(kept[0][0]).expiry == pytest.approx(clock.t + 5 * 86400)
    assert other.retention.priority(plain[0][0]) == 0 and other.retention.priority(plain[1][0]) == 0
    await other.close()


def test_snapshot_retained_section_round_trips_and_a_version_1_snapshot_still_loads() -> None:
    from dynamo_tiered_kv.tiers.objectstore import snapshot as sn

    snap = sn.Snapshot(np.zeros(0, sn.OBJ_DTYPE), {}, np.zeros(0, np.uint64), np.zeros(0, np.uint64),
                       np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint32), 7,
                       retained={b"b" * 16: (30, None), b"a" * 16: (90, 1.5e9)})
    back = sn.decode(sn.encode(snap))
    assert back.retained == {b"a" * 16: (90, 1.5e9), b"b" * 16: (30, None)}
    raw = bytearray(sn.encode(sn.Snapshot(*[getattr(snap, f) for f in ("objects", "odd", "k0", "k1", "obj",
                                                                       "off", "len", "watermark_ms")])))
    raw[8:12] = (1).to_bytes(4, "little")  # the version-1 layout is this one with no retained section
    raw[-16:] = xxhash.xxh3_128_digest(bytes(raw[:-16]))
    assert sn.decode(bytes(raw)).retained == {} and sn.decode(bytes(raw)).watermark_ms == 7
    bad = bytearray(sn.encode(snap))
    bad[8:12] = (1).to_bytes(4, "little")  # version 1 with a retained section: not trusted
    bad[-16:] = xxhash.xxh3_128_digest(bytes(bad[:-16]))
    with pytest.raises(sn.SnapshotError):
        sn.decode(bytes(bad))
