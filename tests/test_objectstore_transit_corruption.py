"""A body damaged on its way into the store is never reused once a reader found it corrupt.

Uploads go out with UNSIGNED-PAYLOAD and no checksum header, so a plain-HTTP S3 server stores a
body a byte of which flipped in transit, under the content-addressed name of the good bytes.
Reads catch it (records carry checksums: a miss, and a quarantine marker). From then on a later
upload of the same content must not be satisfied by that copy: neither by the publish path's
conditional create nor by the flusher's "already stored" skip. A fresh node then reads the good
bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, unique_bucket
from infra.segments_fake import FakeSegmentSource

from dynamo_tiered_kv.blocks.keys import BlockKey
from dynamo_tiered_kv.testing import make_record, random_key
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend
from dynamo_tiered_kv.tiers.objectstore.backend import ObjectBackend
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher
from dynamo_tiered_kv.tiers.objectstore.manifest import DATA_DIR
from dynamo_tiered_kv.tiers.objectstore.quarantine import QUARANTINE_DIR

pytest_plugins = ["infra.fixtures_s3"]

FLIP_AT = 5000  # a payload byte of the first record (its header is the first 4 KiB)


class _UploadCorruptingProxy(FaultProxy):
    """Forwards to the S3 server, flipping the byte at ``corrupt_offset`` of every request body
    that long (the data objects; manifests are shorter): a plain-HTTP link that damages uploads."""

    async def _pipe(self, src, dst, mode, src_w=None) -> None:  # type: ignore[no-untyped-def]
        await super()._pipe(src, dst, "corrupt" if mode == "up" else "pass", src_w)


@dataclass
class Bucket:
    connect: Callable[[], ObjectBackend]  # a sound connection
    damaging: Callable[[], ObjectBackend]  # a connection whose uploads arrive damaged
    settle: Callable[[], None]  # after an upload through ``damaging``: the damage is stored


@pytest.fixture(params=["moto_s3", "localdir"])
async def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Bucket]:
    if request.param == "localdir":  # no wire: the stored file is damaged as a flipped body would be
        root = tmp_path / "bucket"

        def flip() -> None:
            for f in sorted((root / DATA_DIR).glob("*.seg")):
                raw = bytearray(f.read_bytes())
                raw[FLIP_AT] ^= 0xFF
                f.write_bytes(raw)

        yield Bucket(lambda: LocalDirBackend(root), lambda: LocalDirBackend(root), flip)
        return
    server: S3Server = request.getfixturevalue(request.param)
    host, port = server.endpoint.rsplit("//", 1)[1].split(":")
    proxy = await _UploadCorruptingProxy(host, int(port)).start()
    proxy.corrupt_offset = FLIP_AT
    name = unique_bucket("transit")
    try:
        yield Bucket(lambda: S3Backend(name, "kv/", **server.backend_kwargs()),
                     lambda: S3Backend(name, "kv/", **server.backend_kwargs(endpoint_url=proxy.endpoint)),
                     lambda: None)
    finally:
        await proxy.stop()


async def _tier(backend: ObjectBackend) -> ObjectTier:
    tier = ObjectTier(backend, refresh_interval_s=None)
    await tier.open()
    assert await tier.wait_ready(30)
    return tier


async def _read(tier: ObjectTier, keys: list[BlockKey], recs: list[bytes]) -> list[bytes | None]:
    bufs = [bytearray(len(r)) for r in recs]
    got = await tier.read_many([ReadRequest(k, memoryview(b)) for k, b in zip(keys, bufs)])
    return [bytes(b) if n == len(b) else None for n, b in zip(got, bufs)]


async def _markers(bucket: Bucket) -> list[str]:
    b = bucket.connect()
    await b.open()
    try:
        return [o.name for o in await b.list(QUARANTINE_DIR)]
    finally:
        await b.close()


async def _reader_finds_the_damage(bucket: Bucket, keys: list[BlockKey], recs: list[bytes]) -> ObjectTier:
    """A node reads the blocks: the damaged one is a miss and gets a quarantine marker."""
    reader = await _tier(bucket.connect())
    assert await _read(reader, keys, recs) == [None, *recs[1:]]
    assert reader.stats.corrupt_reads == 1
    for t in list(reader._bg):  # the marker is written in the background
        await t
    assert len(await _markers(bucket)) == 1
    return reader


@pytest.mark.parametrize("rewriter", ["reader", "other_node"])
async def test_content_rewritten_after_a_damaged_upload_is_stored_sound(bucket: Bucket, rewriter: str) -> None:
    keys = [random_key(i, b"transit") for i in range(4)]
    recs = [make_record(k, 40 + i) for i, k in enumerate(keys)]
    writer = await _tier(bucket.damaging())
    try:
        await writer.write_many(zip(keys, map(memoryview, recs)))
    finally:
        await writer.close()
    bucket.settle()
    reader = await _reader_finds_the_damage(bucket, keys, recs)
    try:
        # The missed block is recomputed and the same run stored again: by the node that found the
        # damage (it knows), or by another node (it learns from the marker).
        again = reader if rewriter == "reader" else await _tier(bucket.connect())
        try:
            await again.write_many(zip(keys, map(memoryview, recs)))
            assert await _read(again, keys, recs) == recs
            assert again.stats.corrupt_copies_bypassed == 1 and again.stats.objects_published == 1
        finally:
            if again is not reader:
                await again.close()
    finally:
        await reader.close()
    fresh = await _tier(bucket.connect())
    try:
        assert await _read(fresh, keys, recs) == recs
        assert fresh.stats.corrupt_reads == 0
    finally:
        await fresh.close()


async def test_flusher_uploads_a_segment_whose_stored_copy_was_found_damaged(bucket: Bucket, tmp_path: Path) -> None:
    ssd = FakeSegmentSource(tmp_path / "ssd-a")
    seg, recs = ssd.add_segment(4, seed=31)
    keys = [e.key for e in seg.entries]
    node_a = await _tier(bucket.damaging())
    try:
        fl = Flusher(ssd, node_a, scan_interval_s=0.05)
        await fl.start()
        try:
            assert await fl.drain(timeout=30)
        finally:
            await fl.stop()
    finally:
        await node_a.close()
    bucket.settle()
    reader = await _reader_finds_the_damage(bucket, keys, recs)
    await reader.close()

    # Node A (its index lists every record, nothing of the damage) gets the same records back
    # into its SSD in a segment of the same layout: it uploads it, under another name.
    node_a = await _tier(bucket.connect())
    try:
        back = FakeSegmentSource(tmp_path / "ssd-a2")
        same, _ = back.add_segment(4, seed=31)
        assert all(node_a.size_of(e.key) == e.length for e in same.entries)
        fl = Flusher(back, node_a, scan_interval_s=0.05)
        await fl.start()
        try:
            assert await fl.drain(timeout=30)
        finally:
            await fl.stop()
        assert fl.stats.already_stored_segments == 0 and fl.stats.flushed_segments == 1
        assert node_a.stats.corrupt_copies_bypassed == 1
    finally:
        await node_a.close()
    seg.path.unlink()
    same.path.unlink()
    fresh = await _tier(bucket.connect())
    try:
        assert await _read(fresh, keys, recs) == recs
    finally:
        await fresh.close()
