"""Recovery keeps every valid record and one stray entry of a rank directory
never disables the tier (item 8): it is quarantined and the rest is served."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.testing.ssd import open_ssd_tier
from dynamo_tiered_kv.testing.ssd import read_whole as read
from dynamo_tiered_kv.tiers.ssd import SSDTier, metrics
from dynamo_tiered_kv.tiers.ssd.segment import TOMBSTONE_FILE, list_segments

SHAPE = small_shape(num_layers=2)  # 12 KiB records
REC = len(make_record(random_key(0), 0, shape=SHAPE))


def rec(i: int) -> tuple[bytes, bytes]:
    k = random_key(i, b"ssd-recovery")
    return k, make_record(k, i, shape=SHAPE)


async def opened(path: Path, **kw) -> SSDTier:
    kw.setdefault("io", "buffered")
    return await open_ssd_tier(path, **kw)


async def written(path: Path, items: list[tuple[bytes, bytes]], **kw) -> Path:
    t = await opened(path, **kw)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.close()
    return t.rank_dir


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def count(name: str) -> float:
    c = getattr(metrics, name, None)  # absent before the fix: let the behaviour checks fail first
    return c._value.get() if c is not None else 0.0


# --- item 6: one bad record never costs the valid ones after it ------------------------------
async def test_damaged_record_and_footer_keep_every_valid_record(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    items = [rec(i) for i in range(5)]
    rank_dir = await written(tmp_path, items)
    [(_, seg)] = list_segments(rank_dir)
    size = seg.stat().st_size
    assert size == 64 << 10
    flip(seg, REC + 5000)  # a payload byte of record 1
    flip(seg, size - 30)  # a trailer byte: the footer is no longer valid
    before = count("DAMAGED_RECORDS")
    with caplog.at_level(logging.ERROR):
        t = await opened(tmp_path)
    try:
        assert [await read(t, k) == v for k, v in items] == [True, False, True, True, True]
        assert seg.stat().st_size == size, "recovery cut good bytes"
        assert count("DAMAGED_RECORDS") == before + 1
        assert any(f"offset {REC}" in r.getMessage() and seg.name in r.getMessage() for r in caplog.records)
    finally:
        await t.close()
    t = await opened(tmp_path)  # the rebuilt footer is trusted from now on
    try:
        assert sum([await read(t, k) == v for k, v in items]) == 4
    finally:
        await t.close()


async def test_older_segment_is_never_truncated(tmp_path: Path) -> None:
    items = [rec(i) for i in range(12)]  # 5 records per 64 KiB segment: three segments
    rank_dir = await written(tmp_path, items, segment_bytes=64 << 10)
    (_, first), *_ = list_segments(rank_dir)
    with open(first, "r+b") as f:
        f.truncate(2 * REC + 3000)  # records 0 and 1 whole, 2 cut, 3 and 4 gone: not a crash, damage
    flip(first, 100)  # and record 0's header
    t = await opened(tmp_path, segment_bytes=64 << 10)
    try:
        got = [await read(t, k) == v for k, v in items]
        assert got == [False, True, False, False, False] + [True] * 7
        assert first.stat().st_size >= 2 * REC + 3000, "an older segment was cut"
    finally:
        await t.close()


async def test_newest_segment_keeps_valid_records_after_a_damaged_one_and_cuts_only_the_torn_tail(
        tmp_path: Path) -> None:
    items = [rec(i) for i in range(4)]
    live = await opened(tmp_path / "live")
    await live.write_many((k, memoryview(v)) for k, v in items)
    crashed = tmp_path / "crashed" / live.rank_dir.name
    crashed.mkdir(parents=True)
    _, seg = list_segments(live.rank_dir)[-1]
    shutil.copy(seg, crashed)  # the open segment as a crash leaves it: no footer
    await live.close()
    seg = crashed / seg.name
    with open(seg, "ab") as f:
        f.write(rec(99)[1][:6000])  # torn tail
    flip(seg, REC + 5000)
    t = await opened(tmp_path / "crashed")
    try:
        assert [await read(t, k) == v for k, v in items] == [True, False, True, True]
        assert seg.stat().st_size == 4 * REC + 4096, "the torn tail is cut, the records stay"
    finally:
        await t.close()


# --- item 8: quarantine, keep serving ----------------------------------------------------------
def _stray_segment_dir(rank_dir: Path) -> Path:
    p = rank_dir / "seg-00000099.dtkv"
    p.mkdir()
    (p / "x").write_bytes(b"x")
    return p


def _stray_fifo(rank_dir: Path) -> Path:
    p = rank_dir / "seg-00000099.dtkv"
    os.mkfifo(p)
    return p


def _tombstones_dir(rank_dir: Path) -> Path:
    p = rank_dir / TOMBSTONE_FILE
    p.unlink()
    p.mkdir()
    return p


@pytest.mark.parametrize("make_stray", [_stray_segment_dir, _stray_fifo, _tombstones_dir],
                         ids=["segment-is-a-directory", "segment-is-a-fifo", "tombstones-is-a-directory"])
async def test_stray_entry_is_quarantined_and_the_rest_served(tmp_path: Path, make_stray) -> None:
    items = [rec(i) for i in range(8)]
    rank_dir = await written(tmp_path, items, segment_bytes=64 << 10)
    stray = make_stray(rank_dir)
    before = count("QUARANTINED")
    t = await opened(tmp_path, segment_bytes=64 << 10)
    try:
        assert all([await read(t, k) == v for k, v in items])
        assert count("QUARANTINED") == before + 1
        assert not stray.is_dir() and len(list(rank_dir.glob(f"{stray.name}.quarantine-*"))) == 1
        k, v = rec(100)
        await t.write(k, memoryview(v))  # writes and deletes work too
        assert await t.delete(items[0][0])
    finally:
        await t.close()
    t = await opened(tmp_path, segment_bytes=64 << 10)
    try:
        assert await read(t, k) == v and not t.contains(items[0][0])
    finally:
        await t.close()


async def test_unreadable_segment_is_quarantined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    items = [rec(i) for i in range(12)]
    rank_dir = await written(tmp_path, items, segment_bytes=64 << 10)
    _, bad = list_segments(rank_dir)[1]
    real_open = os.open

    def failing_open(path, flags, *a, **kw):  # tests run as root: chmod 000 would not stop us
        if Path(path) == bad:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", failing_open)
    t = await opened(tmp_path, segment_bytes=64 << 10)
    monkeypatch.undo()
    try:
        got = [await read(t, k) == v for k, v in items]
        assert got == [True] * 5 + [False] * 5 + [True] * 2  # 5 records per segment
        assert not bad.exists() and len(list(rank_dir.glob(f"{bad.name}.quarantine-*"))) == 1
        k, v = rec(100)
        await t.write(k, memoryview(v))
        assert t.contains(k)
    finally:
        await t.close()


async def test_quarantined_segment_number_is_never_reused(tmp_path: Path) -> None:
    rank_dir = await written(tmp_path, [rec(0)])
    _stray_segment_dir(rank_dir)
    t = await opened(tmp_path)
    await t.close()
    t = await opened(tmp_path)  # the quarantined name no longer looks like a segment
    try:
        k, v = rec(1)
        await t.write(k, memoryview(v))
        assert list_segments(rank_dir)[-1][0] > 99
    finally:
        await t.close()
