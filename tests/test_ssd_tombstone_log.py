"""The tombstone log: the reader returns intact entries in order and reports a damaged or torn
one with its byte offset; appends never leave a partial entry that would shift later ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.ssd import SSDTier, recovery, segment
from dynamo_tiered_kv.tiers.ssd.segment import (
    DAMAGED,
    TOMBSTONE,
    TOMBSTONE_FILE,
    TORN,
    append_tombstones,
    pack_tombstone,
    parse_tombstones,
    read_tombstones,
)

SHAPE = small_shape(num_layers=2)
ENTRIES = [(1, 0, b"a" * 16), (1, 12288, b"b" * 16), (2, 4096, b"c" * 16)]


def _log() -> bytearray:
    return bytearray(b"".join(pack_tombstone(*e) for e in ENTRIES))


def test_intact_log_reads_every_entry_and_reports_nothing() -> None:
    bad: list[tuple[int, str]] = []
    assert parse_tombstones(bytes(_log()), lambda at, why: bad.append((at, why))) == ENTRIES
    assert bad == []


def test_damaged_and_torn_entries_are_skipped_and_reported() -> None:
    raw = _log()
    raw[TOMBSTONE.size + 9] ^= 0x40  # the second entry's offset field
    raw += pack_tombstone(3, 0, b"d" * 16)[:21]
    bad: list[tuple[int, str]] = []
    assert parse_tombstones(bytes(raw), lambda at, why: bad.append((at, why))) == [ENTRIES[0], ENTRIES[2]]
    assert bad == [(TOMBSTONE.size, DAMAGED), (3 * TOMBSTONE.size, TORN)]
    assert parse_tombstones(bytes(raw)) == [ENTRIES[0], ENTRIES[2]]  # no callback: skipped silently


def test_read_tombstones_from_a_file(tmp_path: Path) -> None:
    assert read_tombstones(tmp_path / "absent.log") == []
    path = tmp_path / "tombstones.log"
    path.write_bytes(bytes(_log()) + b"\0" * 5)
    bad: list[tuple[int, str]] = []
    assert read_tombstones(path, lambda at, why: bad.append((at, why))) == ENTRIES
    assert bad == [(3 * TOMBSTONE.size, TORN)]
    (tmp_path / "dir.log").mkdir()
    with pytest.raises(OSError):
        read_tombstones(tmp_path / "dir.log")  # not a regular file: the caller decides


def test_append_cuts_a_torn_tail_first_so_later_entries_stay_in_step(tmp_path: Path) -> None:
    path = tmp_path / "tombstones.log"
    path.write_bytes(bytes(_log()) + pack_tombstone(9, 0, b"z" * 16)[:7])  # a crash mid-append
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        append_tombstones(fd, pack_tombstone(4, 8192, b"e" * 16))
    finally:
        os.close(fd)
    bad: list[tuple[int, str]] = []
    assert read_tombstones(path, lambda at, why: bad.append((at, why))) == [*ENTRIES, (4, 8192, b"e" * 16)]
    assert bad == []


def test_a_short_append_leaves_no_partial_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tombstones.log"
    path.write_bytes(bytes(_log()))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    real_write = os.write
    try:
        monkeypatch.setattr(segment.os, "write", lambda f, b: real_write(f, bytes(b)[:TOMBSTONE.size + 11]))
        with pytest.raises(OSError, match="short write"):
            append_tombstones(fd, pack_tombstone(4, 0, b"e" * 16) + pack_tombstone(5, 0, b"f" * 16))
        assert path.stat().st_size == 3 * TOMBSTONE.size
        monkeypatch.undo()
        append_tombstones(fd, pack_tombstone(6, 0, b"g" * 16))
    finally:
        os.close(fd)
    assert read_tombstones(path) == [*ENTRIES, (6, 0, b"g" * 16)]


async def test_deletes_after_an_untrimmed_torn_tail_survive_the_next_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up compacts the log (trimming a torn tail) by rewriting it; when that rewrite fails
    (a full disk), later deletes are still appended in step and hold across a restart."""
    items = []
    for i in range(10):
        k = random_key(i, b"tomb")
        items.append((k, make_record(k, i, shape=SHAPE)))

    async def tier() -> SSDTier:
        t = SSDTier(tmp_path, capacity_bytes=16 << 20, segment_bytes=64 << 10, idle_seal_s=None)
        await t.open()
        return t

    t = await tier()
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    assert await t.delete_many([items[0][0]]) == 1
    await t.close()
    log_path = tmp_path / "rank-000" / TOMBSTONE_FILE
    with open(log_path, "ab") as f:
        f.write(pack_tombstone(99, 0, b"x" * 16)[:7])  # torn by a crash

    def no_space(*_a: object) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(recovery.os, "replace", no_space)
        t = await tier()
        assert not t.contains(items[0][0])
        assert await t.delete_many([items[1][0], items[2][0]]) == 2
        await t.close()
    t = await tier()
    try:
        assert [t.contains(k) for k, _ in items[:4]] == [False, False, False, True]
    finally:
        await t.close()
