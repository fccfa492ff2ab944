"""SSD read path for the store's pipeline: slab reads without per-record views, NIXL
transfers of several threads in flight together, descriptors split within one transfer."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.tiers.ssd import io as sio
from dynamo_tiered_kv.tiers.ssd.io import aligned_buffer, probe_odirect
from tests.test_ssd_tier import opened, rec


@pytest.mark.parametrize("verify", [False, True])
async def test_read_slab_coalesces_runs_and_misses_break_them(tmp_path: Path, verify: bool) -> None:
    t = await opened(tmp_path, verify_reads=verify)
    pool = StagingPool(1 << 20, 1, pin=False)
    try:
        items = [rec(i) for i in range(8)]
        n = len(items[0][1])
        await t.write_many((k, memoryview(v)) for k, v in items)
        missing = rec(99)[0]
        keys = [k for k, _ in items[:3]] + [missing] + [k for k, _ in items[3:]]
        dst = pool.acquire()
        before = t.io_stats["read_requests"]
        got = await t.read_slab(keys, dst.array[:len(keys) * n], n)
        assert got == [n, n, n, None, n, n, n, n, n]
        assert t.io_stats["read_requests"] - before == 2  # one read per side of the miss
        for j, k in enumerate(keys):
            if k != missing:
                want = dict(items)[k]
                assert bytes(dst.array[j * n:(j + 1) * n]) == want
        assert await t.read_slab([k for k, _ in items[:2]], dst.array[:2 * (n + 4096)], n + 4096) == [None, None]
    finally:
        await t.close()
        pool.close()


def _nixl_or_skip(tmp_path: Path) -> sio.NixlIO:
    if not probe_odirect(tmp_path):
        pytest.skip("no O_DIRECT here")
    try:
        return sio._probe_nixl(tmp_path)
    except Exception as e:
        pytest.skip(f"NIXL POSIX unavailable: {e}")


def test_nixl_transfers_of_several_threads_overlap_and_split_descriptors(tmp_path: Path, monkeypatch) -> None:
    io = _nixl_or_skip(tmp_path)
    io.nixl_reads = True
    monkeypatch.setattr(sio, "NIXL_DESC_BYTES", 64 << 10)  # a 1 MiB piece is 16 descriptors
    size = 8 << 20
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    src = aligned_buffer(size)
    src[:] = data
    fd = io.open(tmp_path / "seg", create=True)
    try:
        io.write(fd, [src], 0)
        dst = aligned_buffer(size)
        errors: list[BaseException] = []

        def reader(i: int) -> None:
            try:
                for off in range(i << 20, size, 4 << 20):  # two threads, 1 MiB pieces, interleaved
                    io.read(fd, [dst[off:off + (1 << 20)]], off)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        ths = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        assert not errors and io.fallbacks == 0
        assert np.array_equal(dst, data)
    finally:
        io.close_fd(fd)


def test_device_queue_expects_the_bytes_ahead_and_learns_the_device_rate(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(sio.time, "monotonic", lambda: now[0])
    q = sio.DeviceQueue(gbps=1.0)
    a = q.post(8 << 20)
    b = q.post(8 << 20)  # behind a: expected when both are done
    assert b.expect_s == pytest.approx(2 * a.expect_s)
    assert a.expect_s == pytest.approx((8 << 20) / 1e9)
    now[0] += 0.004  # both done in 4 ms: the device moves 16 MiB in 4 ms, ~4.2 GB/s
    q.done(a)
    q.done(b)
    assert 1e9 < q.rate < 4.2e9
    for _ in range(40):
        p = q.post(8 << 20)
        now[0] += 0.002
        q.done(p)
    assert q.rate == pytest.approx((8 << 20) / 0.002, rel=0.01)
    assert q.post(1 << 20).expect_s == pytest.approx(0.25e-3, rel=0.02)  # nothing else in flight


class _SlowAgent:
    """A NIXL agent stand-in whose transfer completes ``after`` seconds after it was posted."""

    def __init__(self, after: float) -> None:
        self.after = after
        self.checks = 0
        self.posted = 0.0

    def transfer(self, h: object) -> str:
        self.posted = sio.time.monotonic()
        return "PROC"

    def check_xfer_state(self, h: object) -> str:
        self.checks += 1
        return "DONE" if sio.time.monotonic() - self.posted >= self.after else "PROC"


def test_wait_sleeps_until_the_expected_completion_then_polls_sparsely() -> None:
    ag = _SlowAgent(0.02)
    sio._wait(ag, object(), None, expect_s=0.02)
    assert sio.time.monotonic() - ag.posted >= 0.02
    informed = ag.checks
    blind = _SlowAgent(0.02)
    sio._wait(blind, object(), None, expect_s=0.0)  # no estimate: polls from the start
    assert informed <= 10 and blind.checks > 2 * informed  # 0.8 x expected, then every 0.5 ms


def test_wait_reports_a_failed_transfer() -> None:
    class Failing(_SlowAgent):
        def check_xfer_state(self, h: object) -> str:
            return "ERR"

    with pytest.raises(OSError, match="ERR"):
        sio._wait(Failing(0.0), object(), None, expect_s=0.001)


def test_nixl_writes_use_larger_requests_than_reads(tmp_path: Path, monkeypatch) -> None:
    io = _nixl_or_skip(tmp_path)
    io.nixl_reads = True
    monkeypatch.setattr(sio, "NIXL_DESC_BYTES", 64 << 10)
    monkeypatch.setattr(sio, "NIXL_WRITE_DESC_BYTES", 256 << 10)
    sizes: dict[str, list[int]] = {"WRITE": [], "READ": []}
    real = io._ag.initialize_xfer

    def spy(op, local, remote, *a):
        sizes[op].append(local.descCount())
        return real(op, local, remote, *a)

    monkeypatch.setattr(io._ag, "initialize_xfer", spy)
    size = 1 << 20
    src = aligned_buffer(size)
    src[:] = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    fd = io.open(tmp_path / "seg", create=True)
    try:
        io.write(fd, [src], 0)
        dst = aligned_buffer(size)
        io.read(fd, [dst], 0)
        assert np.array_equal(dst, src) and io.fallbacks == 0
        assert sizes == {"WRITE": [4], "READ": [16]}
    finally:
        io.close_fd(fd)


def test_restore_reads_are_one_preadv_without_nixl_transfer_setup(tmp_path: Path, monkeypatch) -> None:
    """A restore waits on its reads: no NIXL registration, transfer handle or completion polling
    per read (writes still go through NIXL)."""
    io = _nixl_or_skip(tmp_path)
    ops: list[str] = []
    real = io._ag.initialize_xfer

    def spy(op, *a):
        ops.append(op)
        return real(op, *a)

    monkeypatch.setattr(io._ag, "initialize_xfer", spy)
    preadv_calls = []
    real_preadv = sio.os.preadv
    monkeypatch.setattr(sio.os, "preadv", lambda fd, bufs, off: preadv_calls.append(off) or real_preadv(fd, bufs, off))
    size = 2 << 20
    src = aligned_buffer(size)
    src[:] = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    fd = io.open(tmp_path / "seg", create=True)
    try:
        io.write(fd, [src], 0)
        dst = aligned_buffer(size)
        io.read(fd, [dst[:size // 2], dst[size // 2:]], 0)
        assert np.array_equal(dst, src) and io.fallbacks == 0
        assert ops == ["WRITE"] and preadv_calls == [0]
    finally:
        io.close_fd(fd)
