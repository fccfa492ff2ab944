"""The flusher skips an upload only for what the bucket holds now, not for what its index says.

A node's object index keeps manifests deleted elsewhere (another node's capacity eviction,
``dtkv gc``) until its next full listing. Blocks that come back into this node's SSD in that window
must still be uploaded: once their SSD segment is gone, a fresh node reads them from the bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket
from infra.segments_fake import FakeSegmentSource

from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend
from dynamo_tiered_kv.tiers.objectstore.backend import ObjectBackend
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher
from dynamo_tiered_kv.tiers.objectstore.gc import gc_bucket
from dynamo_tiered_kv.tiers.objectstore.manifest import MANIFEST_DIR

pytest_plugins = ["infra.fixtures_s3"]

Bucket = Callable[[], ObjectBackend]


@pytest.fixture(params=["localdir", "moto_s3"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Bucket:
    """Makes a new connection (one per node) to one shared bucket."""
    if request.param == "localdir":
        return lambda: LocalDirBackend(tmp_path / "bucket")
    server: S3Server = request.getfixturevalue(request.param)
    name = unique_bucket("stale")
    return lambda: S3Backend(name, "kv/", **server.backend_kwargs())


async def _tier(bucket: Bucket, **kw: object) -> ObjectTier:
    tier = ObjectTier(bucket(), refresh_interval_s=None, **kw)  # type: ignore[arg-type]
    await tier.open()
    assert await tier.wait_ready(30)
    return tier


async def _flush(src: FakeSegmentSource, tier: ObjectTier) -> Flusher:
    fl = Flusher(src, tier, scan_interval_s=0.05)
    await fl.start()
    try:
        assert await fl.drain(timeout=30)
    finally:
        await fl.stop()
    return fl


async def _manifests(bucket: Bucket) -> list[str]:
    b = bucket()
    await b.open()
    try:
        return sorted(o.name for o in await b.list(MANIFEST_DIR))
    finally:
        await b.close()


async def _delete_by_other_node(bucket: Bucket, tmp_path: Path, how: str, room: int) -> None:
    """Another node (or the operator's ``dtkv gc``) deletes node A's manifest."""
    if how == "eviction":
        # node B indexes A's object, then stores its own: over its capacity, the oldest goes
        other = FakeSegmentSource(tmp_path / "ssd-b")
        seg_b, _ = other.add_segment(6, seed=12)
        tier_b = await _tier(bucket, capacity_bytes=room)
        try:
            assert tier_b.usage().num_blocks == 6  # A's blocks, indexed
            await tier_b.publish_segment(seg_b)
            assert tier_b.stats.evicted_objects == 1
        finally:
            await tier_b.close()  # waits for the spawned manifest delete
    else:  # dtkv gc run with a shorter TTL than the node's
        b = bucket()
        await b.open()
        try:
            rep = await gc_bucket(b, ttl_s=1.0, now=time.time() + 5, snapshots=False)
            assert rep.expired_manifests == 1 and rep.deleted_data == 0  # the data waits out its grace
        finally:
            await b.close()


@pytest.mark.parametrize("how", ["eviction", "gc"])
async def test_blocks_back_on_the_ssd_are_uploaded_after_a_deletion_elsewhere(
        tmp_path: Path, bucket: Bucket, how: str) -> None:
    ssd = FakeSegmentSource(tmp_path / "ssd-a")
    first, recs = ssd.add_segment(6, seed=11)
    tier_a = await _tier(bucket)
    try:
        await _flush(ssd, tier_a)
        published = await _manifests(bucket)
        assert len(published) == 1
        room = sum(e.length for e in first.entries) + 1  # one node's six records fit, twelve do not
        await _delete_by_other_node(bucket, tmp_path, how, room)
        assert published[0] not in await _manifests(bucket)  # gone from the bucket ...
        keys = [e.key for e in first.entries[:4]]
        assert all(tier_a.contains(k) for k in keys)  # ... not from node A's index (no full listing yet)

        # Four of the blocks come back into node A's SSD (a restore promoted them) and are sealed.
        back = FakeSegmentSource(tmp_path / "ssd-a2")
        again, recs_again = back.add_segment(4, seed=11)
        assert [e.key for e in again.entries] == keys and recs_again == recs[:4]
        fl = await _flush(back, tier_a)
        assert back.is_flushed(again.segment_id)
        assert fl.stats.already_stored_segments == 0 and fl.stats.flushed_segments == 1
        assert tier_a.stats.stale_index_objects == 1
    finally:
        await tier_a.close()

    # Node A's SSD segments are gone; a fresh node reads the blocks from the bucket.
    for seg in (first, again):
        seg.path.unlink()
    tier_c = await _tier(bucket)
    try:
        bufs = [bytearray(len(r)) for r in recs[:4]]
        got = await tier_c.read_many([ReadRequest(k, memoryview(b)) for k, b in zip(keys, bufs)])
        assert got == [len(r) for r in recs[:4]]
        assert [bytes(b) for b in bufs] == recs[:4]
    finally:
        await tier_c.close()


async def test_a_segment_the_bucket_still_holds_is_confirmed_and_skipped(tmp_path: Path, bucket: Bucket) -> None:
    """The check costs requests per object, not per record, and a confirmed skip uploads nothing."""
    ssd = FakeSegmentSource(tmp_path / "ssd-a")
    ssd.add_segment(6, seed=21)
    tier = await _tier(bucket)
    try:
        await _flush(ssd, tier)
        manifests = await _manifests(bucket)
        back = FakeSegmentSource(tmp_path / "ssd-a2")
        again, _ = back.add_segment(5, seed=21)  # five of the six records, one data object serves them
        st = tier.backend.stats
        before = (st.heads, st.lists, st.puts)
        fl = await _flush(back, tier)
        assert fl.stats.already_stored_segments == 1 and fl.stats.flushed_segments == 0
        assert back.is_flushed(again.segment_id)
        assert (st.heads, st.lists, st.puts) == (before[0] + 1, before[1] + 1, before[2])  # 1 HEAD, 1 LIST
        assert await _manifests(bucket) == manifests
        assert tier.stats.stale_index_objects == 0
    finally:
        await tier.close()
