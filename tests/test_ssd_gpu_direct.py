"""The SSD tier's GPU-direct path: records move between registered device slabs and segments.

On CPU the device slabs are page-aligned host memory and NIXL's POSIX backend does the transfers,
so descriptors, registration, segment placement and the failure fallback are all exercised
here; ``test_gds_round_trip_on_gpu`` repeats the round trip through GDS_MT on a GPU.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.staging.device_slabs import DeviceSpan, DeviceStagingPool
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.ssd import SSDTier, metrics
from dynamo_tiered_kv.tiers.ssd.gds import DeviceIO
from dynamo_tiered_kv.tiers.ssd.gds_probe import gds_verdict

pytest.importorskip("nixl")
SHAPE = small_shape(num_layers=2)


def records(n: int, tag: bytes = b"gd") -> list[tuple[bytes, bytes]]:
    return [(random_key(i, tag), make_record(random_key(i, tag), i, shape=SHAPE)) for i in range(n)]


def put(slab, recs: list[tuple[bytes, bytes]]) -> list[DeviceSpan]:
    spans, off = [], 0
    for _, v in recs:
        slab.tensor[off:off + len(v)].copy_(torch.frombuffer(bytearray(v), dtype=torch.uint8))
        spans.append(DeviceSpan(slab, off, len(v)))
        off += len(v)
    return spans


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[SSDTier, DeviceStagingPool, DeviceIO]]:
    pool = DeviceStagingPool(1 << 20, 2, "cpu")
    dio = DeviceIO("POSIX")
    dio.register(pool.slabs)
    t = SSDTier(tmp_path, capacity_bytes=64 << 20, segment_bytes=512 << 10, io="odirect", idle_seal_s=None,
                device_io=dio)
    await t.open()
    if t.io_path != "odirect":
        pytest.skip("this filesystem refuses O_DIRECT")
    yield t, pool, dio
    await t.close()
    dio.close()
    pool.close()


async def test_device_records_round_trip_and_read_back_through_host_too(rig) -> None:
    t, pool, _ = rig
    src, dst = pool.slabs
    recs = records(12)
    await t.write_many(zip([k for k, _ in recs], put(src, recs)))
    assert t.io_stats["write_requests"] == 1  # one contiguous run, one transfer
    n = len(recs[0][1])
    got = await t.read_many([ReadRequest(k, DeviceSpan(dst, j * n, n)) for j, (k, _) in enumerate(recs)])
    assert got == [n] * len(recs)
    assert t.io_stats["read_requests"] == 1
    assert torch.equal(dst.tensor[:n * len(recs)], src.tensor[:n * len(recs)])
    host = [bytearray(n) for _ in recs]  # same segment format: the host path reads them as well
    assert await t.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(recs, host)]) == [n] * len(recs)
    assert [bytes(b) for b in host] == [v for _, v in recs]


async def test_device_records_survive_a_restart(rig, tmp_path: Path) -> None:
    t, pool, dio = rig
    recs = records(5, b"restart")
    await t.write_many(zip([k for k, _ in recs], put(pool.slabs[0], recs)))
    await t.close()
    t2 = SSDTier(tmp_path, capacity_bytes=64 << 20, idle_seal_s=None, device_io=dio)
    await t2.open()
    try:
        n = len(recs[0][1])
        dst = pool.slabs[1]
        got = await t2.read_many([ReadRequest(k, DeviceSpan(dst, j * n, n)) for j, (k, _) in enumerate(recs)])
        assert got == [n] * len(recs)
        assert bytes(dst.tensor[:n * len(recs)].numpy()) == b"".join(v for _, v in recs)
    finally:
        await t2.close()


async def test_mixed_batches_are_refused(rig) -> None:
    t, pool, _ = rig
    recs = records(2, b"mixed")
    spans = put(pool.slabs[0], recs)
    with pytest.raises(ValueError, match="either all host"):
        await t.write_many([(recs[0][0], spans[0]), (recs[1][0], memoryview(recs[1][1]))])
    with pytest.raises(ValueError, match="either all host"):
        await t.read_many([ReadRequest(recs[0][0], spans[0]), ReadRequest(recs[1][0], memoryview(bytearray(8192)))])


async def test_device_writes_without_a_gpu_direct_path_are_refused(tmp_path: Path) -> None:
    pool = DeviceStagingPool(1 << 20, 1, "cpu")
    t = SSDTier(tmp_path, capacity_bytes=8 << 20, idle_seal_s=None)
    await t.open()
    try:
        assert t.device_io is None
        recs = records(1, b"nodio")
        with pytest.raises(TierUnavailable, match="GPU-direct"):
            await t.write_many(zip([recs[0][0]], put(pool.slabs[0], recs)))
    finally:
        await t.close()
        pool.close()


async def test_a_failing_gpu_direct_path_detaches_and_host_io_keeps_working(rig,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    t, pool, dio = rig
    good = records(3, b"before")
    await t.write_many(zip([k for k, _ in good], put(pool.slabs[0], good)))
    failures = metrics.GPU_DIRECT_FAILURES._value.get()

    def broken(*a, **kw):
        raise OSError(5, "cuFile says no")

    monkeypatch.setattr(dio, "write", broken)
    bad = records(3, b"after")
    with pytest.raises(TierUnavailable, match="GPU-direct write"):
        await t.write_many(zip([k for k, _ in bad], put(pool.slabs[0], bad)))
    assert metrics.GPU_DIRECT_FAILURES._value.get() == failures + 1
    assert t.device_io is None and t.readonly_reason is None  # not the disk's fault
    assert not any(t.contains(k) for k, _ in bad)
    # device reads now miss (the caller retries through host staging); host I/O still works
    n = len(good[0][1])
    assert await t.read_many([ReadRequest(good[0][0], DeviceSpan(pool.slabs[1], 0, n))]) == [None]
    await t.write_many((k, memoryview(v)) for k, v in bad)
    buf = bytearray(n)
    assert await t.read_many([ReadRequest(bad[0][0], memoryview(buf))]) == [n] and bytes(buf) == bad[0][1]
    assert await t.read_many([ReadRequest(good[0][0], memoryview(buf))]) == [n] and bytes(buf) == good[0][1]


async def test_a_failing_gpu_direct_read_is_a_miss_never_stale_bytes(rig, monkeypatch: pytest.MonkeyPatch) -> None:
    t, pool, dio = rig
    recs = records(2, b"rd")
    await t.write_many(zip([k for k, _ in recs], put(pool.slabs[0], recs)))

    def broken(*a, **kw):
        raise OSError(5, "NIXL transfer ended in state ERR")

    monkeypatch.setattr(dio, "read", broken)
    n = len(recs[0][1])
    got = await t.read_many([ReadRequest(k, DeviceSpan(pool.slabs[1], j * n, n)) for j, (k, _) in enumerate(recs)])
    assert got == [None, None] and t.device_io is None


def test_spans_outside_their_slab_or_unregistered_are_refused(tmp_path: Path) -> None:
    import os

    pool = DeviceStagingPool(1 << 16, 2, "cpu")
    dio = DeviceIO("POSIX")
    dio.register(pool.slabs[:1])
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(ValueError, match="outside"):
            dio.write(fd, [DeviceSpan(pool.slabs[0], (1 << 16) - 4096, 8192)], 0)
        with pytest.raises(ValueError, match="never registered"):
            dio.write(fd, [DeviceSpan(pool.slabs[1], 0, 4096)], 0)
    finally:
        dio.forget(fd)
        os.close(fd)
        dio.close()
        pool.close()


@pytest.mark.gpu
async def test_gds_round_trip_on_gpu(tmp_path: Path) -> None:
    verdict = gds_verdict()
    if not verdict.available:
        pytest.skip(f"GPUDirect Storage not usable here: {verdict.reason}")
    pool = DeviceStagingPool(1 << 20, 2, "cuda")
    dio = DeviceIO("GDS_MT")
    dio.register(pool.slabs)
    t = SSDTier(tmp_path, capacity_bytes=64 << 20, idle_seal_s=None, device_io=dio)
    await t.open()
    try:
        assert t.device_io is dio
        recs = records(16, b"gds")
        await t.write_many(zip([k for k, _ in recs], put(pool.slabs[0], recs)))
        n = len(recs[0][1])
        got = await t.read_many([ReadRequest(k, DeviceSpan(pool.slabs[1], j * n, n)) for j, (k, _) in enumerate(recs)])
        assert got == [n] * len(recs)
        assert torch.equal(pool.slabs[1].tensor[:n * 16], pool.slabs[0].tensor[:n * 16])
    finally:
        await t.close()
        dio.close()
        pool.close()


async def test_active_gauge_counts_only_tiers_using_the_path(tmp_path: Path) -> None:
    base = metrics.GPU_DIRECT_ACTIVE._value.get()
    pool = DeviceStagingPool(1 << 16, 1, "cpu")
    dio = DeviceIO("POSIX")
    dio.register(pool.slabs)
    first = SSDTier(tmp_path, capacity_bytes=8 << 20, io="odirect", idle_seal_s=None, device_io=dio)
    locked_out = SSDTier(tmp_path, capacity_bytes=8 << 20, io="odirect", idle_seal_s=None, device_io=dio)
    await first.open()
    await locked_out.open()  # same rank directory: disabled before it ever uses the path
    try:
        assert locked_out.disabled_reason and locked_out.device_io is None
        assert metrics.GPU_DIRECT_ACTIVE._value.get() == base + (1 if first.io_path == "odirect" else 0)
    finally:
        await locked_out.close()
        await first.close()
        dio.close()
        pool.close()
    assert metrics.GPU_DIRECT_ACTIVE._value.get() == base


@pytest.mark.parametrize("fault", ["raises", "wrong bytes"])
async def test_a_path_that_fails_its_start_up_self_test_is_never_used(tmp_path: Path, fault: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pool = DeviceStagingPool(1 << 16, 1, "cpu")
    dio = DeviceIO("POSIX")
    dio.register(pool.slabs)
    real_read = dio.read

    def bad_read(fd, spans, offset):
        if fault == "raises":
            raise OSError(5, "cuFileHandleRegister failed (5030)")
        real_read(fd, spans, offset)
        spans[0].slab.tensor[spans[0].offset + 7] ^= 1  # a path that silently serves wrong bytes

    monkeypatch.setattr(dio, "read", bad_read)
    failures = metrics.GPU_DIRECT_FAILURES._value.get()
    t = SSDTier(tmp_path, capacity_bytes=8 << 20, io="odirect", idle_seal_s=None, device_io=dio)
    await t.open()
    try:
        if t.io_path != "odirect":
            pytest.skip("this filesystem refuses O_DIRECT")
        assert t.available and t.device_io is None
        assert metrics.GPU_DIRECT_FAILURES._value.get() == failures + 1
        assert not list(t.rank_dir.glob(".gdio-probe-*"))
        k, v = records(1, b"selftest")[0]
        await t.write(k, memoryview(v))  # the host path is unaffected
        buf = bytearray(len(v))
        assert await t.read_into(k, memoryview(buf)) == len(v) and bytes(buf) == v
    finally:
        await t.close()
        dio.close()
        pool.close()
