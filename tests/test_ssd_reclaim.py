"""Deletes free disk bytes: emptied sealed segments are unlinked, dead records punched out of the rest."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.blocks.codec import verify_record
from dynamo_tiered_kv.cli import main
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.ssd import SSDTier, metrics, reads, reclaim
from dynamo_tiered_kv.tiers.ssd.holes import allocated_bytes, allocated_in, whole_blocks
from dynamo_tiered_kv.tiers.ssd.segment import list_segments, read_footer_at
from dynamo_tiered_kv.tiers.ssd.space import bytes_held_by

SHAPE = small_shape(num_layers=2)
PER_SEG = 5  # 12 KiB records in 64 KiB segments (a 4 KiB footer)


def _items(n: int, tag: bytes = b"reclaim") -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(n):
        k = random_key(i, tag)
        out.append((k, make_record(k, i, shape=SHAPE)))
    return out


async def _tier(root: Path, **kw: object) -> SSDTier:
    t = SSDTier(root, capacity_bytes=16 << 20, segment_bytes=64 << 10, idle_seal_s=None, **kw)  # type: ignore[arg-type]
    await t.open()
    return t


def _rank(root: Path) -> Path:
    return root / "rank-000"


def _extents(path: Path) -> dict[bytes, tuple[int, int]]:
    footer = read_footer_at(path, path.stat().st_size)
    assert footer is not None
    e = footer.entries
    return {k: (o, n) for k, o, n in zip(e["key"].tolist(), e["offset"].tolist(), e["length"].tolist())}


def _held(path: Path, off: int, n: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return allocated_in(fd, off, n)
    finally:
        os.close(fd)


async def _reads_back(t: SSDTier, items: list[tuple[bytes, bytes]]) -> None:
    bufs = [np.zeros(len(v), np.uint8) for _, v in items]
    got = await t.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(items, bufs)])
    assert got == [len(v) for _, v in items]
    for (k, v), b in zip(items, bufs):
        assert b.tobytes() == v
        verify_record(b, key=k)


def test_whole_blocks_merges_neighbours_and_keeps_partial_blocks() -> None:
    assert whole_blocks([(8192, 4096), (4096, 4096)], 4096) == [(4096, 8192)]
    assert whole_blocks([(4096, 4096), (12288, 4096)], 8192) == []  # each only half a block
    assert whole_blocks([(4096, 4096), (8192, 8192)], 8192) == [(8192, 8192)]


async def test_emptied_sealed_segment_is_unlinked(tmp_path: Path) -> None:
    t = await _tier(tmp_path)
    items = _items(3 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    segs = list_segments(_rank(tmp_path))
    assert len(segs) == 3
    used = t.usage().used_bytes
    first = segs[0][1]
    size = first.stat().st_size
    before = metrics.RECLAIMED_SEGMENTS._value.get()
    assert await t.delete_many(k for k, _ in items[:PER_SEG]) == PER_SEG
    assert not first.exists()
    assert t.usage().used_bytes == used - size
    assert metrics.RECLAIMED_SEGMENTS._value.get() == before + 1
    await _reads_back(t, items[PER_SEG:])
    await t.close()
    t = await _tier(tmp_path)  # the restart agrees
    assert not any(t.contains(k) for k, _ in items[:PER_SEG])
    await _reads_back(t, items[PER_SEG:])
    await t.close()


async def test_dead_records_of_a_live_segment_are_punched(tmp_path: Path) -> None:
    t = await _tier(tmp_path)
    items = _items(2 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    path = list_segments(_rank(tmp_path))[0][1]
    size, held = path.stat().st_size, allocated_bytes(path)
    ext = _extents(path)
    dead, live = items[0:PER_SEG:2], items[1:PER_SEG:2]
    assert await t.delete_many(k for k, _ in dead) == len(dead)
    assert path.stat().st_size == size  # offsets and footer stay where they were
    assert all(_held(path, *ext[k]) == 0 for k, _ in dead)
    assert all(_held(path, *ext[k]) == ext[k][1] for k, _ in live)
    assert allocated_bytes(path) == held - sum(len(v) for _, v in dead)
    assert bytes_held_by(tmp_path, {k for k, _ in dead}) == 0
    await _reads_back(t, live + items[PER_SEG:])
    await t.close()

    # restart: the punched records are dead (tombstoned), the segment is neither failed nor quarantined
    t = await _tier(tmp_path)
    assert not any(t.contains(k) for k, _ in dead)
    await _reads_back(t, live + items[PER_SEG:])
    await t.close()
    assert not [p for p in _rank(tmp_path).iterdir() if "quarantine" in p.name]


async def test_fsck_counts_punched_records_as_freed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = await _tier(tmp_path)
    items = _items(2 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    await t.delete_many([items[1][0], items[3][0]])
    await t.close()
    assert main(["fsck", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["corrupt_count"] == 0
    assert report["records_freed"] == 2 and report["records_ok"] == 2 * PER_SEG - 2


async def test_crash_after_punching_recovers_live_records(tmp_path: Path) -> None:
    """A writer process punches and unlinks, then dies without closing (its open segment torn)."""
    script = f"""
import asyncio, os, sys
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from tests.test_ssd_reclaim import _items, _tier, PER_SEG
from pathlib import Path

async def go():
    t = await _tier(Path({str(tmp_path)!r}))
    items = _items(3 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    await t.delete_many([k for k, _ in items[:2]] + [k for k, _ in items[PER_SEG:2 * PER_SEG]])
    await t.write_many((k, memoryview(v)) for k, v in _items(2, b"tail"))
    os._exit(0)

asyncio.run(go())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    segs = [p.name for _, p in list_segments(_rank(tmp_path))]
    assert "seg-00000002.dtkv" not in segs  # emptied and unlinked before the crash
    items = _items(3 * PER_SEG)
    t = await _tier(tmp_path)
    assert not any(t.contains(k) for k, _ in items[:2] + items[PER_SEG:2 * PER_SEG])
    await _reads_back(t, items[2:PER_SEG] + items[2 * PER_SEG:] + _items(2, b"tail"))
    await t.close()
    assert main(["fsck", str(tmp_path)]) == 0


async def test_open_segment_is_left_alone_until_sealed(tmp_path: Path) -> None:
    t = await _tier(tmp_path)
    items = _items(3)  # fewer than a segment: it stays open
    await t.write_many((k, memoryview(v)) for k, v in items)
    assert await t.delete_many([items[0][0]]) == 1
    assert bytes_held_by(tmp_path, {items[0][0]}) == len(items[0][1])
    assert await t.seal_deleted() is True
    assert bytes_held_by(tmp_path, {items[0][0]}) == 0
    assert await t.seal_deleted() is False  # nothing left to free
    await _reads_back(t, items[1:])
    await t.close()


async def test_newest_segment_is_punched_not_unlinked_so_its_seq_is_never_reused(tmp_path: Path) -> None:
    t = await _tier(tmp_path)
    items = _items(3)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    await t.delete_many(k for k, _ in items)
    ((seq, path),) = list_segments(_rank(tmp_path))
    assert path.exists() and bytes_held_by(tmp_path, {k for k, _ in items}) == 0
    await t.close()
    t = await _tier(tmp_path)
    more = _items(1, b"next")
    await t.write_many((k, memoryview(v)) for k, v in more)
    assert [s for s, _ in list_segments(_rank(tmp_path))] == [seq, seq + 1]  # seq + 1, not seq again
    await t.seal()  # a newer segment exists now: the emptied one goes
    assert [s for s, _ in list_segments(_rank(tmp_path))] == [seq + 1]
    await _reads_back(t, more)
    await t.close()


async def test_a_read_in_flight_keeps_its_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = await _tier(tmp_path)
    items = _items(3 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    gate, entered = threading.Event(), threading.Event()
    real = reads.read_extent

    def slow_read(*a: object, **kw: object) -> None:
        entered.set()
        assert gate.wait(30)
        real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(reads, "read_extent", slow_read)
    first = list_segments(_rank(tmp_path))[0][1]
    # 1. a read of a segment that a delete empties: the file goes, the open fd still serves the read
    buf = np.zeros(len(items[0][1]), np.uint8)
    task = asyncio.ensure_future(t.read_many([ReadRequest(items[0][0], memoryview(buf))]))
    assert await asyncio.to_thread(entered.wait, 30)
    await t.delete_many(k for k, _ in items[:PER_SEG])
    assert not first.exists()
    gate.set()
    assert await task == [len(items[0][1])]
    assert buf.tobytes() == items[0][1]

    # 2. a read of a record that a delete kills in a live segment: punching waits for it
    gate.clear()
    entered.clear()
    path = list_segments(_rank(tmp_path))[0][1]
    ext = _extents(path)
    victim = items[PER_SEG]
    buf = np.zeros(len(victim[1]), np.uint8)
    task = asyncio.ensure_future(t.read_many([ReadRequest(victim[0], memoryview(buf))]))
    assert await asyncio.to_thread(entered.wait, 30)
    await t.delete_many([victim[0]])
    assert _held(path, *ext[victim[0]]) == ext[victim[0]][1]
    gate.set()
    assert await task == [len(victim[1])]
    assert buf.tobytes() == victim[1]
    monkeypatch.setattr(reads, "read_extent", real)
    await t.delete_many([])  # the next delete call frees what was deferred
    assert _held(path, *ext[victim[0]]) == 0
    await t.close()


async def test_pinned_or_unflushed_segments_wait(tmp_path: Path) -> None:
    t = await _tier(tmp_path, allow_evict_unflushed=True)  # so only the pin keeps the emptied one
    items = _items(3 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    sealed = t.unflushed_segments()  # a flusher is attached from now on
    first, second = sealed[0], sealed[1]
    # pinned (uploading): not unlinked
    assert t.pin_segment(first.segment_id)
    await t.delete_many(k for k, _ in items[:PER_SEG])
    assert Path(first.path).exists()
    t.unpin_segment(first.segment_id)
    await t.delete_many([])
    assert not Path(first.path).exists()
    # unflushed with a flusher attached: the upload reads every record, so no punching yet
    dead = items[PER_SEG]
    await t.delete_many([dead[0]])
    assert bytes_held_by(tmp_path, {dead[0]}) == len(dead[1])
    t.mark_flushed(second.segment_id)
    await t.delete_many([])
    assert bytes_held_by(tmp_path, {dead[0]}) == 0
    await t.close()


async def test_a_filesystem_without_hole_punching_is_reported_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    def refuse(fd: int, off: int, n: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(reclaim, "punch_hole", refuse)
    before = metrics.PUNCH_UNSUPPORTED._value.get()
    t = await _tier(tmp_path)
    items = _items(3 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    with caplog.at_level(logging.WARNING, logger=reclaim.__name__):
        await t.delete_many([items[0][0]])
        await t.delete_many([items[1][0]])
        assert await t.delete_many(k for k, _ in items[PER_SEG:2 * PER_SEG]) == PER_SEG
    assert metrics.PUNCH_UNSUPPORTED._value.get() == before + 1
    assert sum("cannot punch holes" in r.message for r in caplog.records) == 1
    assert bytes_held_by(tmp_path, {items[0][0], items[1][0]}) == 2 * len(items[0][1])  # left in place
    assert len(list_segments(_rank(tmp_path))) == 2  # emptied segments are still unlinked
    await _reads_back(t, items[2:PER_SEG] + items[2 * PER_SEG:])
    tail = _items(2, b"open")
    await t.write_many((k, memoryview(v)) for k, v in tail)
    await t.delete_many([tail[0][0]])
    assert await t.seal_deleted() is False  # sealing would free nothing without punching
    await t.close()


async def test_overwritten_records_are_freed_at_the_next_seal(tmp_path: Path) -> None:
    t = await _tier(tmp_path)
    items = _items(2 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    path = list_segments(_rank(tmp_path))[0][1]
    ext = _extents(path)
    k0, v0 = items[0]
    await t.write_many([(k0, memoryview(v0))])  # the new copy lands in the open segment
    await t.seal()
    assert _held(path, *ext[k0]) == 0
    await _reads_back(t, items)
    await t.close()


async def test_tombstones_are_synced_before_a_punch_even_without_fsync(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_sync, real_punch = os.fdatasync, reclaim.punch_hole

    def sync(fd: int) -> None:
        events.append("sync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_sync(fd)

    def punch(fd: int, off: int, n: int) -> None:
        events.append("punch")
        real_punch(fd, off, n)

    t = await _tier(tmp_path, fsync=False)
    items = _items(2 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    monkeypatch.setattr(os, "fdatasync", sync)
    monkeypatch.setattr(reclaim, "punch_hole", punch)
    await t.delete_many([items[0][0], items[2][0]])
    assert events[:2] == ["sync tombstones.log", "punch"]
    assert bytes_held_by(tmp_path, {items[0][0], items[2][0]}) == 0
    await t.close()


async def test_the_flusher_is_offered_live_records_only(tmp_path: Path) -> None:
    """A record deleted (expired, demoted) or superseded after its seal is not published, so it
    cannot come back through the object tier; a segment left with none is not offered at all."""
    t = await _tier(tmp_path)
    items = _items(2 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    await t.delete_many([items[1][0], items[3][0]])
    await t.write_many([(items[4][0], memoryview(items[4][1]))])  # superseded by a newer copy
    await t.seal()
    offered = {e.key for s in t.unflushed_segments() for e in s.entries}
    assert offered == {k for k, _ in items} - {items[1][0], items[3][0]}
    first = t.unflushed_segments()[0]
    assert [e.key for e in first.entries] == [items[0][0], items[2][0]]  # the newer copy of 4 is elsewhere

    hook_keys: list[bytes] = []

    class Hook:
        def flushed(self, keys: list[bytes]) -> None:
            hook_keys.extend(keys)

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return lambda *a, **k: None

    t.set_residency_hook(Hook())  # type: ignore[arg-type]
    t.mark_flushed(first.segment_id)
    assert hook_keys == [items[0][0], items[2][0]]  # residency: only what the object tier got
    await t.close()


async def test_an_emptied_segment_goes_even_before_it_is_flushed(tmp_path: Path) -> None:
    t = await _tier(tmp_path)  # unflushed segments are not evictable: a flusher is attached below
    items = _items(2 * PER_SEG)
    await t.write_many((k, memoryview(v)) for k, v in items)
    await t.seal()
    first = t.unflushed_segments()[0]
    await t.delete_many(k for k, _ in items[:PER_SEG])
    assert not Path(first.path).exists()  # nothing live in it: nothing owed to the object tier
    assert first.segment_id not in {s.segment_id for s in t.unflushed_segments()}
    await _reads_back(t, items[PER_SEG:])
    await t.close()
