"""The background flusher: sealed segments -> object tier, backpressure, failures, crash-resume."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, unique_bucket
from infra.segments_fake import FakeSegmentSource

from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, RetryPolicy, S3Backend
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher

pytest_plugins = ["infra.fixtures_s3"]


class GatedBackend(LocalDirBackend):
    """A local directory whose uploads wait for ``gate`` (to hold work in flight)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()

    async def put_object(self, name, source, *, if_absent=False):
        await self.gate.wait()
        return await super().put_object(name, source, if_absent=if_absent)


async def _restore_all(tier: ObjectTier, segs: list, recs: list[list[bytes]]) -> None:
    """Each segment's records restore byte-exact with one GET per segment (a contiguous run)."""
    for seg, rs in zip(segs, recs):
        bufs = [bytearray(len(r)) for r in rs]
        before = tier.stats.gets
        got = await tier.read_many([ReadRequest(e.key, memoryview(b)) for e, b in zip(seg.entries, bufs)])
        assert got == [len(r) for r in rs]
        assert [bytes(b) for b in bufs] == rs
        assert tier.stats.gets - before == 1


async def _flush_all(src, tmp_path: Path) -> Flusher:
    """Run a flusher over ``src`` into a local-directory object tier until it has drained."""
    tier = ObjectTier(LocalDirBackend(tmp_path / "obj"))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    fl = Flusher(src, tier, scan_interval_s=0.05)
    await fl.start()
    try:
        assert await fl.drain(timeout=30)
    finally:
        await fl.stop()
        await tier.close()
    return fl


async def test_flushes_every_sealed_segment(tmp_path: Path) -> None:
    src = FakeSegmentSource(tmp_path / "ssd")
    made = [src.add_segment(8, seed=s) for s in range(3)]
    fl = await _flush_all(src, tmp_path)
    assert all(src.is_flushed(s.segment_id) for s, _ in made)
    st = fl.stats
    assert st.flushed_segments == 3 and st.flushed_bytes == sum(s.size for s, _ in made)
    assert st.lag_bytes == 0 and st.failures == 0 and st.in_flight == 0
    fresh = ObjectTier(LocalDirBackend(tmp_path / "obj"))  # a restart: index from manifests
    await fresh.open()
    await fresh.wait_ready()  # open() returns at once; the index builds in the background
    try:
        await _restore_all(fresh, [s for s, _ in made], [r for _, r in made])
    finally:
        await fresh.close()


async def test_backpressure_bounds_the_queue(tmp_path: Path) -> None:
    src = FakeSegmentSource(tmp_path / "ssd")
    for s in range(6):
        src.add_segment(2, seed=s, sealed_at=time.time() - 100)
    backend = GatedBackend(tmp_path / "obj")
    tier = ObjectTier(backend)
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    fl = Flusher(src, tier, max_queue=2, concurrency=1, scan_interval_s=0.02)
    await fl.start()
    try:
        await asyncio.sleep(0.3)  # several scans while the only worker is stuck
        st = fl.stats
        assert st.in_flight == 1 and st.queue_length == 2  # bounded: 3 of 6 taken, 3 wait on the SSD
        assert st.queue_full_events > 0
        assert st.lag_bytes == sum(s.size for s in src.unflushed_segments())
        assert st.lag_seconds >= 100
        backend.gate.set()
        assert await fl.drain(timeout=30)
    finally:
        await fl.stop()
        await tier.close()
    assert not src.unflushed_segments()
    assert src.max_pins_seen == 1 and not src.pins
    assert fl.stats.lag_bytes == 0 and fl.stats.lag_seconds == 0


async def test_failures_are_counted_then_retried(tmp_path: Path, moto_s3: S3Server) -> None:
    src = FakeSegmentSource(tmp_path / "ssd")
    made = [src.add_segment(4, seed=10 + s) for s in range(2)]
    host, port = moto_s3.endpoint.rsplit("//", 1)[1].split(":")
    proxy = await FaultProxy(host, int(port)).start()
    bucket = unique_bucket("flushfail")
    setup = S3Backend(bucket, **moto_s3.backend_kwargs())
    await setup.open()  # create the bucket directly
    await setup.close()
    backend = S3Backend(bucket, **{**moto_s3.backend_kwargs(), "endpoint_url": proxy.endpoint,
                                   "create_bucket": False},
                        retry=RetryPolicy(max_attempts=2, base_delay_s=0.01, attempt_timeout_s=5),
                        breaker_threshold=1000)
    tier = ObjectTier(backend)
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    proxy.set_mode("http503")
    fl = Flusher(src, tier, scan_interval_s=0.05, retry_base_s=0.05, retry_max_s=0.2)
    await fl.start()
    try:
        for _ in range(200):
            if fl.stats.failures >= 2:
                break
            await asyncio.sleep(0.05)
        st = fl.stats
        assert st.failures >= 2 and "TierUnavailable" in st.last_error
        assert st.flushed_segments == 0 and st.lag_bytes == sum(s.size for s, _ in made)
        assert not any(src.is_flushed(s.segment_id) for s, _ in made)
        proxy.set_mode("pass")
        assert await fl.drain(timeout=30)
        await _restore_all(tier, [s for s, _ in made], [r for _, r in made])
    finally:
        await fl.stop()
        await tier.close()
        await proxy.stop()


async def test_crash_mid_upload_publishes_nothing_then_resumes(tmp_path: Path, moto_s3: S3Server) -> None:
    """A flusher killed during a multipart upload leaves nothing visible; a new one finishes it."""
    src = FakeSegmentSource(tmp_path / "ssd")
    seg, recs = src.add_segment(90, seed=20, num_layers=32)  # ~12 MiB: a 3-part multipart upload
    assert seg.size > 10 << 20
    host, port = moto_s3.endpoint.rsplit("//", 1)[1].split(":")
    proxy = await FaultProxy(host, int(port)).start()
    bucket = unique_bucket("flushcrash")
    kwargs = {**moto_s3.backend_kwargs(), "endpoint_url": proxy.endpoint, "part_bytes": 5 << 20}
    tier = ObjectTier(S3Backend(bucket, "p/", **kwargs))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    proxy.delay_s = 1.0
    proxy.set_mode("delay")  # uploads crawl
    fl = Flusher(src, tier, scan_interval_s=0.05)
    await fl.start()
    for _ in range(100):
        if fl.stats.in_flight:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    assert fl.stats.in_flight == 1 and proxy.connections > 0
    await fl.stop()  # the "crash": uploads cancelled mid-flight
    proxy.set_mode("pass")
    assert not src.is_flushed(seg.segment_id)
    assert await tier.backend.list("") == []  # nothing half-written is visible
    await tier.close()

    src2 = FakeSegmentSource(tmp_path / "ssd")  # restart: progress comes from the SSD side
    tier2 = ObjectTier(S3Backend(bucket, "p/", **kwargs))
    await tier2.open()
    await tier2.wait_ready()  # open() returns at once; the index builds in the background
    fl2 = Flusher(src2, tier2, scan_interval_s=0.05)
    await fl2.start()
    try:
        assert await fl2.drain(timeout=60)
        assert src2.is_flushed(seg.segment_id)
        await _restore_all(tier2, [seg], [recs])
        names = [o.name for o in await tier2.backend.list("")]
        assert len([n for n in names if n.startswith("data/")]) == 1
        assert len([n for n in names if n.startswith("manifests/")]) == 1
    finally:
        await fl2.stop()
        await tier2.close()
        await proxy.stop()


async def test_reflush_is_idempotent(tmp_path: Path) -> None:
    """Uploading a segment twice (crash after upload, before mark_flushed) stores it once."""
    src = FakeSegmentSource(tmp_path / "ssd")
    seg, _ = src.add_segment(4, seed=30)
    tier = ObjectTier(LocalDirBackend(tmp_path / "obj"))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    try:
        m1 = await tier.publish_segment(seg)
        m2 = await tier.publish_segment(seg)
        assert m1.data == m2.data and m1.name == m2.name
        assert tier.stats.objects_published == 1 and tier.stats.objects_deduplicated == 1
        names = [o.name for o in await tier.backend.list("")]
        assert len(names) == 2
    finally:
        await tier.close()


def test_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Flusher(FakeSegmentSource(tmp_path), ObjectTier(LocalDirBackend(tmp_path)), max_queue=0)


class ThreadRecordingSource(FakeSegmentSource):
    """Records the thread of each blocking call (listing reads footers; marking fsyncs)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.threads: dict[str, set[int]] = {"unflushed_segments": set(), "mark_flushed": set()}

    def unflushed_segments(self):  # type: ignore[no-untyped-def]
        self.threads["unflushed_segments"].add(threading.get_ident())
        return super().unflushed_segments()

    def mark_flushed(self, segment_id: str) -> None:
        self.threads["mark_flushed"].add(threading.get_ident())
        super().mark_flushed(segment_id)


async def test_disk_io_of_the_source_runs_off_the_event_loop(tmp_path: Path) -> None:
    src = ThreadRecordingSource(tmp_path / "ssd")
    made = [src.add_segment(2, seed=s) for s in range(2)]
    await _flush_all(src, tmp_path)
    assert all(src.is_flushed(s.segment_id) for s, _ in made)
    assert all(src.threads.values()), src.threads
    loop_thread = threading.get_ident()
    assert all(loop_thread not in t for t in src.threads.values()), "the flusher blocked the event loop"


async def test_segment_flushed_during_a_scan_is_not_queued_again(tmp_path: Path) -> None:
    """A listing that started before a worker finished returns that segment as unflushed: stale."""
    src = ThreadRecordingSource(tmp_path / "ssd")
    seg, _ = src.add_segment(2, seed=0)
    tier = ObjectTier(LocalDirBackend(tmp_path / "obj"))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    fl = Flusher(src, tier, scan_interval_s=0.02)
    uploading = threading.Event()
    overlaps = 0
    listed, publish = src.unflushed_segments, tier.publish_segment

    async def slow_publish(s):  # type: ignore[no-untyped-def]
        uploading.set()
        await asyncio.sleep(0.2)  # several scans start meanwhile
        return await publish(s)

    def slow_listing():  # type: ignore[no-untyped-def]
        nonlocal overlaps
        segs = listed()
        if segs and uploading.is_set() and fl._stats.flushed_segments == 0:
            overlaps += 1
            deadline = time.monotonic() + 10
            while fl._stats.flushed_segments == 0 and time.monotonic() < deadline:
                time.sleep(0.005)  # return the stale list only after the worker finished
        return segs

    src.unflushed_segments = slow_listing  # type: ignore[method-assign]
    tier.publish_segment = slow_publish  # type: ignore[method-assign]
    await fl.start()
    try:
        assert await fl.drain(timeout=30)
        await asyncio.sleep(0.2)  # a few more scans
    finally:
        await fl.stop()
        await tier.close()
    assert overlaps and src.is_flushed(seg.segment_id)
    assert fl.stats.flushed_segments == 1 and tier.stats.objects_deduplicated == 0
