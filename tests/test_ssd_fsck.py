"""``dtkv fsck``: clean directories pass; a corrupted byte is found and named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dynamo_tiered_kv.cli import main
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.ssd import SSDTier
from dynamo_tiered_kv.tiers.ssd.segment import TOMBSTONE, list_segments

SHAPE = small_shape(num_layers=2)


async def _populate(root: Path, n: int = 12, close: bool = True) -> tuple[SSDTier, list[tuple[bytes, bytes]]]:
    t = SSDTier(root, capacity_bytes=16 << 20, segment_bytes=64 << 10, idle_seal_s=None)
    await t.open()
    items = []
    for i in range(n):
        k = random_key(i, b"fsck")
        items.append((k, make_record(k, i, shape=SHAPE)))
    await t.write_many((k, memoryview(v)) for k, v in items)
    if close:
        await t.close()
    return t, items


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


async def test_clean_directory_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _populate(tmp_path)
    assert main(["fsck", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "12 records verified" in out and "clean" in out


async def test_corrupt_byte_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, items = await _populate(tmp_path)
    _, seg = list_segments(tmp_path / "rank-000")[1]
    rec_len = len(items[0][1])
    _flip(seg, rec_len + 5000)  # second record of the second segment, inside its payload
    assert main(["fsck", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("CORRUPT"))
    assert seg.name in line and f"offset {rec_len}" in line and "ChecksumMismatch" in line
    assert main(["fsck", "--json", str(tmp_path / "rank-000")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["corrupt_count"] == 1 and report["records_ok"] == 11
    bad = report["problems"][0]
    assert bad["offset"] == rec_len and len(bad["key"]) == 32


async def test_unsealed_segment_torn_tail_is_a_warning_but_damage_before_valid_records_is_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t, items = await _populate(tmp_path / "live", n=3, close=False)
    crashed = tmp_path / "crashed" / "rank-000"
    crashed.mkdir(parents=True)
    _, seg = list_segments(t.rank_dir)[-1]
    shutil.copy(seg, crashed)  # the open segment as a crash leaves it
    await t.close()
    seg = crashed / seg.name
    with open(seg, "ab") as f:
        f.write(items[0][1][:6000])
    assert main(["fsck", str(tmp_path / "crashed")]) == 0
    assert "warning" in capsys.readouterr().out
    _flip(seg, 100)  # damage the first record's header: valid records follow it
    assert main(["fsck", str(tmp_path / "crashed")]) == 1
    assert "a valid record follows" in capsys.readouterr().out


def test_missing_target_or_empty_directory_cannot_be_checked(tmp_path: Path) -> None:
    assert main(["fsck", str(tmp_path / "nope")]) == 2
    assert main(["fsck", str(tmp_path)]) == 2  # no tier data


def test_url_target_is_handed_to_the_object_tier_checker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("dynamo_tiered_kv.tiers.objectstore.fsck")
    assert main(["fsck", f"file://{tmp_path}"]) == 0
    assert "0 records verified" in capsys.readouterr().out


async def test_truncated_older_segment_is_corruption_but_a_torn_newest_one_is_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _populate(tmp_path)  # 12 records of 12 KiB in 64 KiB segments: three segments
    segs = list_segments(tmp_path / "rank-000")
    assert len(segs) == 3
    newest = segs[-1][1]
    with open(newest, "r+b") as f:
        f.truncate(12288 + 5000)  # looks like a crash of the open segment: a warning
    assert main(["fsck", str(tmp_path)]) == 0
    assert "warning" in capsys.readouterr().out
    first = segs[0][1]
    with open(first, "r+b") as f:
        f.truncate(12288 + 5000)  # the same cut in a segment that was sealed: no crash did that
    assert main(["fsck", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("CORRUPT"))
    assert first.name in line and "not the newest" in line
    assert "1 corrupt" in out


async def test_stray_entries_are_reported_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _populate(tmp_path)
    rank_dir = tmp_path / "rank-000"
    (rank_dir / "seg-00000099.dtkv").mkdir()
    (rank_dir / "tombstones.log").unlink(missing_ok=True)
    (rank_dir / "tombstones.log").mkdir()
    assert main(["fsck", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "12 records verified" in out and "seg-00000099.dtkv" in out and "tombstones.log" in out


async def test_torn_and_damaged_tombstones_are_warnings_with_their_offset(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, items = await _populate(tmp_path)
    t = SSDTier(tmp_path, capacity_bytes=16 << 20, segment_bytes=64 << 10, idle_seal_s=None)
    await t.open()
    assert await t.delete_many([items[1][0], items[3][0]]) == 2  # two tombstones; both records punched
    await t.close()
    log = tmp_path / "rank-000" / "tombstones.log"
    assert log.stat().st_size == 2 * TOMBSTONE.size
    with open(log, "ab") as f:
        f.write(b"\x01" * 17)  # a crash in the middle of the third append
    assert main(["fsck", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tombstones"] == 2 and report["records_freed"] == 2
    assert [(p["offset"], p["error"], p["corrupt"]) for p in report["problems"]] == [
        (2 * TOMBSTONE.size, "torn last tombstone (ignored by recovery)", False)]

    _flip(log, TOMBSTONE.size + 3)  # the second entry: the punched record it named looks live
    assert main(["fsck", "--json", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["tombstones"] == 1 and report["records_freed"] == 1
    warnings = [(p["offset"], p["error"]) for p in report["problems"] if not p["corrupt"]]
    assert warnings == [(TOMBSTONE.size, "damaged tombstone (ignored by recovery)"),
                        (2 * TOMBSTONE.size, "torn last tombstone (ignored by recovery)")]
    assert report["corrupt_count"] == 1
