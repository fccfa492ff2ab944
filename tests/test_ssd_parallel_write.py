"""A large run is appended as a few concurrent sub-writes, and fails as one write does.

Real O_DIRECT files in ``tmp_path``; concurrency is observed through the I/O object the tier
writes with (a ``PosixIO`` subclass, or the NIXL transfer method of the tier's ``NixlIO``), never
through timing.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dynamo_tiered_kv.blocks.codec import ALIGN
from dynamo_tiered_kv.blocks.layout import BlockShape, CanonicalFormat, DType
from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.testing import make_record, random_key
from dynamo_tiered_kv.testing.ssd import open_ssd_tier
from dynamo_tiered_kv.testing.ssd import read_whole as read
from dynamo_tiered_kv.tiers.ssd import SSDTier
from dynamo_tiered_kv.tiers.ssd.io import PosixIO, address_of, aligned_buffer, probe_odirect
from dynamo_tiered_kv.tiers.ssd.parallel_write import SPLIT_BYTES, WRITERS, plan_parts, split_extent

SHAPE = BlockShape(CanonicalFormat.KV_SPLIT, DType.BFLOAT16, 32, 16, 8, 128)  # 2 MiB payload per record
RUN = 16  # records of one run: 32 MiB and a little, four sub-extents
BARRIER_S = 5.0  # how long a sub-write waits for the others to be in flight with it


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not probe_odirect(tmp_path):
        pytest.skip("no O_DIRECT here")
    return tmp_path


def records(tag: bytes, n: int, first: int = 0) -> list[tuple[bytes, bytes]]:
    keys = [random_key(i, tag) for i in range(first, first + n)]
    return [(k, make_record(k, i, shape=SHAPE)) for i, k in enumerate(keys, first)]


def staged(items: list[tuple[bytes, bytes]]) -> tuple[np.ndarray, list[tuple[bytes, np.ndarray]]]:
    """The records copied back to back into one page-aligned buffer (as a staging slab holds them)."""
    n = len(items[0][1])
    buf = aligned_buffer(n * len(items))
    for j, (_, v) in enumerate(items):
        buf[j * n:(j + 1) * n] = np.frombuffer(v, np.uint8)
    return buf, [(k, buf[j * n:(j + 1) * n]) for j, (k, _) in enumerate(items)]


async def opened(path: Path, io: str = "odirect") -> SSDTier:
    return await open_ssd_tier(path, io=io, capacity_bytes=512 << 20, segment_bytes=128 << 20)


def segment_file(t: SSDTier) -> Path:
    seg = t._state.open
    assert seg is not None
    return seg.path


class InFlight:
    """Counts calls in flight; while armed, each call waits (bounded) for ``parties`` to be in
    flight together, so calls that are issued concurrently are seen concurrently."""

    def __init__(self, parties: int) -> None:
        self._lock = threading.Lock()
        self.barrier: threading.Barrier | None = threading.Barrier(parties, timeout=BARRIER_S)
        self.now = 0
        self.most = 0
        self.calls: list[tuple[int, int, bool]] = []  # (file offset, bytes, every buffer O_DIRECT-aligned)

    @contextlib.contextmanager
    def call(self, bufs: Sequence[np.ndarray], offset: int):
        aligned = offset % ALIGN == 0 and all(address_of(b) % ALIGN == 0 and b.nbytes % ALIGN == 0 for b in bufs)
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.calls.append((offset, sum(b.nbytes for b in bufs), aligned))
        try:
            if self.barrier is not None:
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.barrier.wait()
            yield
        finally:
            with self._lock:
                self.now -= 1


class WatchedIO(PosixIO):
    """O_DIRECT pwritev that reports its write calls to an ``InFlight``."""

    def __init__(self, watch: InFlight) -> None:
        super().__init__(direct=True)
        self.watch = watch

    def write(self, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
        with self.watch.call(bufs, offset):
            super().write(fd, bufs, offset)


def check_parts(watch: InFlight, start: int, total: int) -> None:
    """The run went out as WRITERS aligned sub-writes, all in flight at once, covering it exactly."""
    calls = sorted(watch.calls)
    assert len(calls) == WRITERS, calls
    assert watch.most == WRITERS
    assert all(aligned for _, _, aligned in calls)
    assert calls[0][0] == start and sum(n for _, n, _ in calls) == total
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(calls))


# --- splitting -------------------------------------------------------------------------------
def test_split_keeps_every_part_aligned_and_covers_the_run() -> None:
    sizes = [3 * ALIGN, (2 << 20) + ALIGN, 5 * ALIGN, (7 << 20) + 9 * ALIGN, 6 << 20, 11 * ALIGN, (4 << 20) + ALIGN]
    srcs = [aligned_buffer(n) for n in sizes]
    for i, s in enumerate(srcs):
        s[:] = np.arange(s.nbytes, dtype=np.uint64).astype(np.uint8) ^ i
    total = sum(sizes)
    cuts = plan_parts(total, split_bytes=2 << 20, writers=4)
    assert len(cuts) == 3 and all(c % ALIGN == 0 for c in cuts)
    parts = split_extent(srcs, 1 << 30, cuts)
    assert [off - (1 << 30) for off, _ in parts] == [0, *cuts]
    assert all(address_of(b) % ALIGN == 0 and b.nbytes % ALIGN == 0 for _, bufs in parts for b in bufs)
    joined = b"".join(bytes(b) for _, bufs in parts for b in bufs)
    assert joined == b"".join(bytes(s) for s in srcs)


def test_runs_below_two_split_sizes_are_not_split() -> None:
    assert plan_parts(2 * SPLIT_BYTES - ALIGN) == []
    assert len(plan_parts(2 * SPLIT_BYTES)) == 1
    assert len(plan_parts(100 * SPLIT_BYTES)) == WRITERS - 1


# --- the append path -------------------------------------------------------------------------
async def test_large_run_is_written_as_concurrent_sub_writes(direct_dir: Path) -> None:
    t = await opened(direct_dir)
    watch = InFlight(WRITERS)
    t._state.io = WatchedIO(watch)
    try:
        items = records(b"par", RUN)
        _, views = staged(items)
        total = sum(len(v) for _, v in items)
        await t.write_many((k, memoryview(v)) for k, v in views)
        watch.barrier = None
        check_parts(watch, 0, total)
        with open(segment_file(t), "rb") as f:
            assert f.read(total) == b"".join(v for _, v in items)
        for k, v in (items[0], items[7], items[-1]):
            assert await read(t, k) == v

        watch.calls.clear()  # a small run (a few records) stays one write
        small = records(b"small", 3)
        _, small_views = staged(small)
        await t.write_many((k, memoryview(v)) for k, v in small_views)
        assert len(watch.calls) == 1 and watch.calls[0][:2] == (total, sum(len(v) for _, v in small))
    finally:
        await t.close()


class OnePartFails(PosixIO):
    """O_DIRECT pwritev; once armed, the sub-write at ``fail_at`` fails at once with EIO and every
    other write of ``slow_bytes`` or more sleeps ``slow_s`` first, then writes its bytes."""

    def __init__(self, slow_bytes: int, slow_s: float = 0.5) -> None:
        super().__init__(direct=True)
        self.fail_at: int | None = None
        self.slow_bytes = slow_bytes
        self.slow_s = slow_s
        self.finished: list[int] = []  # offsets of slow sub-writes that wrote their bytes

    def write(self, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
        if self.fail_at is None:
            super().write(fd, bufs, offset)
            return
        if offset == self.fail_at:
            raise OSError(errno.EIO, "injected sub-write failure")
        if sum(b.nbytes for b in bufs) >= self.slow_bytes:
            time.sleep(self.slow_s)
            super().write(fd, bufs, offset)
            self.finished.append(offset)
            return
        super().write(fd, bufs, offset)


@pytest.mark.parametrize("failing", ["first", "last"])
async def test_failed_sub_write_fails_the_run_after_all_sub_writes_stopped(direct_dir: Path, failing: str) -> None:
    t = await opened(direct_dir)
    io = OnePartFails(slow_bytes=SPLIT_BYTES // 2)
    t._state.io = io
    try:
        before = records(b"kept", 1, first=100)
        _, before_views = staged(before)
        await t.write_many((k, memoryview(v)) for k, v in before_views)
        start = len(before[0][1])
        path = segment_file(t)

        items = records(b"lost", RUN)
        _, views = staged(items)
        total = sum(len(v) for _, v in items)
        cuts = plan_parts(total)
        assert len(cuts) == WRITERS - 1
        io.fail_at = start + (0 if failing == "first" else cuts[-1])
        with pytest.raises(TierUnavailable, match="injected sub-write failure"):
            await t.write_many((k, memoryview(v)) for k, v in views)
        finished_at_raise = len(io.finished)
        size_at_raise = path.stat().st_size
        time.sleep(2 * io.slow_s)  # a sub-write still running after the truncate would land now

        assert finished_at_raise == WRITERS - 1, "the run failed before its other sub-writes stopped"
        assert size_at_raise == start and path.stat().st_size == start, "bytes of the failed run are in the file"
        assert not any(t.contains(k) for k, _ in items)
        assert await read(t, before[0][0]) == before[0][1]
    finally:
        await t.close()


# --- NIXL ------------------------------------------------------------------------------------
async def test_nixl_large_run_is_several_concurrent_transfers(direct_dir: Path) -> None:
    t = await opened(direct_dir, io="nixl")
    try:
        io: Any = t._state.io
        if t.io_path != "nixl":
            pytest.skip(f"NIXL POSIX unavailable here (io path {t.io_path})")
        watch = InFlight(WRITERS)
        real = io._xfer

        def xfer(op: str, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
            with watch.call(bufs, offset):
                real(op, fd, bufs, offset)

        io._xfer = xfer
        items = records(b"nixl", RUN)
        _, views = staged(items)
        total = sum(len(v) for _, v in items)
        await t.write_many((k, memoryview(v)) for k, v in views)
        watch.barrier = None
        check_parts(watch, 0, total)
        assert io.fallbacks == 0
        with open(segment_file(t), "rb") as f:
            assert f.read(total) == b"".join(v for _, v in items)
    finally:
        await t.close()
