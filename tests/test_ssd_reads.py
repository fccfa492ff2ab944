"""SSD read path for the store's pipeline (issue 11): slab reads without per-record views, NIXL
transfers of several threads in flight together, descriptors split within one transfer."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.staging import StagingPool
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
