"""The tombstone log reader: intact entries in order; a damaged or torn entry is skipped and
reported with its byte offset."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_tiered_kv.tiers.ssd.segment import (
    DAMAGED,
    TOMBSTONE,
    TORN,
    pack_tombstone,
    parse_tombstones,
    read_tombstones,
)

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
