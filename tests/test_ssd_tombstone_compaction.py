"""The tombstone log is compacted while the tier runs: many deletes keep it bounded, a kill during
the rewrite loses no delete and revives no record, and a segment file still on disk keeps its
tombstones. Real SSD tier, real files; the kills are SIGKILLs of a writer process."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.codec import verify_record
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.ssd import SSDTier, tombstones
from dynamo_tiered_kv.tiers.ssd.segment import TOMBSTONE, TOMBSTONE_FILE, read_tombstones, segment_name

SHAPE = small_shape(num_layers=2)  # 12 KiB records
SEGMENT_BYTES = 64 << 10  # four records and a footer
MIN_BYTES = 32 * TOMBSTONE.size  # compaction threshold floor for these tests (1 MiB in production)


def _key(tag: str, i: int) -> bytes:
    return random_key(i, tag.encode())


def _records(tag: str, n: int) -> list[tuple[bytes, bytes]]:
    return [(_key(tag, i), make_record(_key(tag, i), i, shape=SHAPE)) for i in range(n)]


async def _tier(root: Path) -> SSDTier:
    t = SSDTier(root, capacity_bytes=64 << 20, segment_bytes=SEGMENT_BYTES, idle_seal_s=None)
    await t.open()
    assert t.available, t.disabled_reason
    return t


def _log_path(root: Path) -> Path:
    return root / "rank-000" / TOMBSTONE_FILE


def _live_entries(root: Path) -> int:
    """Entries of the log whose segment file exists (what any compaction must keep)."""
    rank = root / "rank-000"
    return sum((rank / segment_name(s)).exists() for s, _, _ in read_tombstones(_log_path(root)))


async def _check(root: Path, present: list[tuple[bytes, bytes]], absent: list[bytes]) -> None:
    """Restart: every record of ``present`` reads back verified and byte-identical, no key of
    ``absent`` is served, and no temp log is left."""
    t = await _tier(root)
    try:
        for k, rec in present:
            buf = bytearray(len(rec))
            assert await t.read_into(k, memoryview(buf)) == len(rec), "a live record was lost"
            verify_record(buf, key=k)
            assert bytes(buf) == rec
        assert not [k for k in absent if t.contains(k)], "a deleted record came back"
        assert not (root / "rank-000" / tombstones.TOMBSTONE_TMP).exists()
    finally:
        await t.close()


async def test_many_deletes_in_one_process_keep_the_log_bounded(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tombstones, "COMPACT_MIN_BYTES", MIN_BYTES)
    keep = _records("keep", 4)  # one segment that stays: its deleted records' tombstones are live
    t = await _tier(tmp_path)
    appended = 0
    sizes = []
    try:
        await t.write_many((k, memoryview(v)) for k, v in keep)
        await t.seal()
        assert await t.delete_many([k for k, _ in keep[:2]]) == 2
        appended += 2
        gone: list[bytes] = [k for k, _ in keep[:2]]
        for r in range(60):  # a segment written and emptied per round: its tombstones die with it
            batch = _records(f"r{r}", 4)
            await t.write_many((k, memoryview(v)) for k, v in batch)
            await t.seal()
            for k, _ in batch:  # one delete per call: a tombstone append each
                assert await t.delete_many([k]) == 1
            appended += len(batch)
            gone += [k for k, _ in batch]
            size = _log_path(tmp_path).stat().st_size
            sizes.append(size)
            # the bound: compaction keeps the log within 4x its live entries (or the floor), plus one append
            assert size <= max(MIN_BYTES, 4 * _live_entries(tmp_path) * TOMBSTONE.size) + 2 * TOMBSTONE.size
        assert appended * TOMBSTONE.size > 4 * max(sizes)  # it was compacted, several times over
        assert any(b < a for a, b in itertools.pairwise(sizes))
        entries = read_tombstones(_log_path(tmp_path))
        assert len(entries) == len({(s, o) for s, o, _ in entries})  # each location once
    finally:
        await t.close()
    await _check(tmp_path, keep[2:], gone)


async def test_a_segment_file_still_on_disk_keeps_its_tombstones(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Compaction drops a segment's tombstones only once its file is gone: a file that is still
    there (its unlink failed, or did not reach the disk) would bring its deleted records back."""
    monkeypatch.setattr(tombstones, "COMPACT_MIN_BYTES", MIN_BYTES)
    first = _records("first", 4)
    t = await _tier(tmp_path)
    try:
        await t.write_many((k, memoryview(v)) for k, v in first)
        await t.seal()
        seg_path = next(p for p in (tmp_path / "rank-000").iterdir() if p.suffix == ".dtkv")
        saved = tmp_path / "saved.dtkv"
        shutil.copyfile(seg_path, saved)
        assert await t.delete_many([k for k, _ in first]) == 4
        for r in range(12):  # later segments emptied too: dead tombstones enough for compactions
            batch = _records(f"r{r}", 4)
            await t.write_many((k, memoryview(v)) for k, v in batch)
            await t.seal()
            if r == 0:
                assert not seg_path.exists()  # emptied and unlinked once no longer the newest
                shutil.copyfile(saved, seg_path)  # ...but the file is back, as after a lost unlink
            assert await t.delete_many([k for k, _ in batch]) == 4
        assert _log_path(tmp_path).stat().st_size < 13 * 4 * TOMBSTONE.size  # compacted
        seq = int(seg_path.stem.split("-")[1])
        assert sum(s == seq for s, _, _ in read_tombstones(_log_path(tmp_path))) == 4
    finally:
        await t.close()
    await _check(tmp_path, [], [k for k, _ in first])


_WRITER = textwrap.dedent("""
    import asyncio, os, signal, sys
    from dynamo_tiered_kv.testing import make_record, random_key, small_shape
    from dynamo_tiered_kv.tiers.ssd import SSDTier, tombstones

    root, when, journal = sys.argv[1:4]
    tombstones.COMPACT_MIN_BYTES, seg_bytes = int(sys.argv[4]), int(sys.argv[5])
    real_replace = os.replace

    def replace(src, dst):  # the kill lands between the temp log's fsync and its rename, or right after
        if str(src).endswith(tombstones.TOMBSTONE_TMP):
            if when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = replace
    shape = small_shape(num_layers=2)

    def recs(tag, n):
        return [(random_key(i, tag.encode()), make_record(random_key(i, tag.encode()), i, shape=shape))
                for i in range(n)]

    def note(line):
        with open(journal, "a") as j:
            j.write(line + "\\n")
            j.flush()
            os.fsync(j.fileno())

    async def main():
        t = SSDTier(root, capacity_bytes=64 << 20, segment_bytes=seg_bytes, idle_seal_s=None)
        await t.open()
        keep = recs("keep", 4)
        await t.write_many((k, memoryview(v)) for k, v in keep)
        await t.seal()
        await t.delete_many([k for k, _ in keep[:2]])
        note("keep")
        for r in range(1000):
            batch = recs(f"r{r}", 4)
            await t.write_many((k, memoryview(v)) for k, v in batch)
            await t.seal()
            note(f"W {r}")
            for i, (k, _) in enumerate(batch):
                await t.delete_many([k])
                note(f"d {r} {i}")

    asyncio.run(main())
""")


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_kill_during_compaction_loses_no_delete_and_revives_no_record(tmp_path: Path, when: str) -> None:
    """SIGKILL between the temp log's fsync and its rename (the old log stays, the temp file is
    left behind), or right after the rename (the new log, its directory entry maybe not synced)."""
    journal = tmp_path / "journal"
    root = tmp_path / "ssd"
    p = subprocess.run([sys.executable, "-c", _WRITER, str(root), when, str(journal), str(MIN_BYTES),
                        str(SEGMENT_BYTES)], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    lines = [ln.split() for ln in journal.read_text().splitlines()]
    assert lines[0] == ["keep"] and lines[-1][0] in ("W", "d")
    deleted = [(int(ln[1]), int(ln[2])) for ln in lines if ln[0] == "d"]
    rounds = max(int(ln[1]) for ln in lines if ln[0] == "W") + 1
    assert deleted, "killed before any compaction could be due"
    tmp_log = root / "rank-000" / tombstones.TOMBSTONE_TMP
    assert tmp_log.exists() == (when == "before")
    keep = _records("keep", 4)
    acked = set(deleted)
    in_flight = next((r, i) for r in range(rounds) for i in range(4) if (r, i) not in acked)
    gone = [k for k, _ in keep[:2]] + [_records(f"r{r}", 4)[i][0] for r, i in sorted(acked)]
    # never deleted: the records after the delete in flight at the kill (that one may go either way)
    kept = keep[2:] + [rec for r in range(rounds) for i, rec in enumerate(_records(f"r{r}", 4))
                       if (r, i) not in acked and (r, i) != in_flight]
    await _check(root, kept, gone)
    assert os.path.getsize(_log_path(root)) % TOMBSTONE.size == 0
