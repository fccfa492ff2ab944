"""A failing SSD directory degrades to "no SSD tier" (or read-only), never a crash or a hang.

The ENOSPC, read-only and O_DIRECT-refused cases use real small filesystems (tmpfs, ramfs)
mounted for the test; they skip where mounting is not permitted.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.ssd import SSDTier, metrics

SHAPE = small_shape(num_layers=2)


def rec(i: int) -> tuple[bytes, bytes]:
    k = random_key(i, b"degrade")
    return k, make_record(k, i, shape=SHAPE)


def _mount(target: Path, fstype: str, options: str) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(target)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {r.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    yield from _mount(tmp_path / "small", "tmpfs", "size=256k")


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    yield from _mount(tmp_path / "ram", "ramfs", "mode=755")


async def test_unusable_directory_disables_the_tier(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    t = SSDTier(tmp_path / "file" / "ssd", capacity_bytes=1 << 20, idle_seal_s=None)
    await t.open()
    try:
        assert not t.available and "cannot use" in (t.disabled_reason or "")
        assert metrics.DISABLED._value.get() >= 1
        k, v = rec(1)
        assert not t.contains(k)
        assert await t.read_into(k, memoryview(bytearray(len(v)))) is None
        with pytest.raises(TierUnavailable):
            await t.write(k, memoryview(v))
    finally:
        await t.close()


async def test_second_writer_on_a_rank_directory_is_refused(tmp_path: Path) -> None:
    a = SSDTier(tmp_path, capacity_bytes=1 << 20, idle_seal_s=None)
    b = SSDTier(tmp_path, capacity_bytes=1 << 20, idle_seal_s=None)
    c = SSDTier(tmp_path, capacity_bytes=1 << 20, rank=1, idle_seal_s=None)
    await a.open()
    await b.open()
    await c.open()
    try:
        assert a.available and c.available
        assert not b.available and "locked" in (b.disabled_reason or "")
    finally:
        for t in (a, b, c):
            await t.close()


async def test_enospc_stops_writes_but_keeps_serving_reads(small_tmpfs: Path) -> None:
    filler = small_tmpfs / "filler"
    filler.write_bytes(bytes(64 << 10))
    t = SSDTier(small_tmpfs, capacity_bytes=64 << 20, segment_bytes=64 << 10, idle_seal_s=None,
                write_retry_s=3600)
    await t.open()
    try:
        assert t.available
        stored = []
        with pytest.raises(TierUnavailable):
            for i in range(100):  # 256 KiB filesystem: fills after about 20 records
                k, v = rec(i)
                await t.write(k, memoryview(v))
                stored.append((k, v))
        assert stored and "No space" in (t.readonly_reason or "")
        for k, v in stored:
            buf = bytearray(len(v))
            assert await t.read_into(k, memoryview(buf)) == len(v) and bytes(buf) == v
        k, v = rec(1000)
        with pytest.raises(TierUnavailable, match="not accepting writes"):  # fails fast until the retry time
            await t.write(k, memoryview(v))
        filler.unlink()
        t._state.write_retry_s = 0  # the retry period has passed
        await t.write(k, memoryview(v))  # space is back: writes resume
        stored.append((k, v))
    finally:
        await t.close()
    t2 = SSDTier(small_tmpfs, capacity_bytes=64 << 20, segment_bytes=64 << 10, idle_seal_s=None)
    await t2.open()
    try:  # nothing half-written became visible
        assert {k for k, _ in stored} <= set(t2.keys())
    finally:
        await t2.close()


async def test_read_only_filesystem_disables_the_tier(small_tmpfs: Path) -> None:
    t = SSDTier(small_tmpfs, capacity_bytes=1 << 20, idle_seal_s=None)
    await t.open()
    k, v = rec(1)
    await t.write(k, memoryview(v))
    await t.close()
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True)
    if r.returncode:
        pytest.skip("cannot remount read-only")
    t2 = SSDTier(small_tmpfs, capacity_bytes=1 << 20, idle_seal_s=None)
    await t2.open()
    try:
        assert not t2.available and "Read-only" in (t2.disabled_reason or "")
        with pytest.raises(TierUnavailable):
            await t2.write(k, memoryview(v))
    finally:
        await t2.close()


async def test_o_direct_refused_falls_back_to_buffered(ramfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    t = SSDTier(ramfs, capacity_bytes=1 << 20, idle_seal_s=None)
    await t.open()
    try:
        assert t.available and t.io_path == "buffered"
        assert any("refuses O_DIRECT" in r.getMessage() for r in caplog.records)
        k, v = rec(1)
        await t.write(k, memoryview(v))
        buf = bytearray(len(v))
        assert await t.read_into(k, memoryview(buf)) == len(v) and bytes(buf) == v
    finally:
        await t.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the verdict on a machine without a GPU")
async def test_gds_probe_fails_cleanly_without_a_gpu(tmp_path: Path) -> None:
    t = SSDTier(tmp_path, capacity_bytes=1 << 20, idle_seal_s=None)
    await t.open()
    try:
        assert t.available and not t.gds.available and t.gds.reason
        assert metrics.GDS_AVAILABLE._value.get() == 0
    finally:
        await t.close()
