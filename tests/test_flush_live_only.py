"""The flusher uploads live records only: records deleted or superseded before the upload are
neither in the data object nor in its manifest, and the live ones restore from the object tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.testing.ssd import open_ssd_tier
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher
from dynamo_tiered_kv.tiers.objectstore.manifest import Manifest
from dynamo_tiered_kv.tiers.segments import SealedSegment


def _records(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    shape = small_shape(num_layers=2)
    return [(random_key(seed * 1000 + i, b"live"), make_record(random_key(seed * 1000 + i, b"live"),
                                                                seed * 1000 + i, shape=shape)) for i in range(n)]


async def _flush(ssd, root: Path, **kw) -> Flusher:
    tier = ObjectTier(LocalDirBackend(root))
    await tier.open()
    await tier.wait_ready()
    fl = Flusher(ssd, tier, scan_interval_s=0.05, **kw)
    await fl.start()
    try:
        assert await fl.drain(timeout=30)
    finally:
        await fl.stop()
        await tier.close()
    return fl


def _bucket(root: Path) -> tuple[list[Path], list[Manifest]]:
    return (sorted(root.rglob("data/*.seg")),
            [Manifest.from_bytes(p.read_bytes()) for p in sorted(root.rglob("manifests/*.json"))])


async def _restore(root: Path, recs: list[tuple[bytes, bytes]]) -> list[int | None]:
    """Read ``recs`` back from a fresh object tier over ``root`` (its index built from manifests)."""
    tier = ObjectTier(LocalDirBackend(root))
    await tier.open()
    await tier.wait_ready()
    try:
        bufs = [bytearray(len(r)) for _, r in recs]
        got = await tier.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(recs, bufs, strict=True)])
        for n, b, (_, r) in zip(got, bufs, recs, strict=True):
            if n is not None:
                assert bytes(b) == r
        return got
    finally:
        await tier.close()


async def test_a_flushed_segment_holds_exactly_its_live_records(tmp_path: Path) -> None:
    ssd = await open_ssd_tier(tmp_path / "ssd")
    try:
        recs = _records(10, seed=1)
        await ssd.write_many([(k, memoryview(r)) for k, r in recs])
        dead = [recs[i] for i in (1, 4, 5, 8)]  # a lone record, a run of two, one more
        live = [r for r in recs if r not in dead]
        for k, _ in dead:
            assert await ssd.delete(k)
        assert isinstance(await ssd.seal(), SealedSegment)
        fl = await _flush(ssd, tmp_path / "obj")
        assert not ssd.unflushed_segments()
    finally:
        await ssd.close()
    data, manifests = _bucket(tmp_path / "obj")
    assert len(data) == 1 and len(manifests) == 1
    assert data[0].stat().st_size == sum(len(r) for _, r in live)  # the 6 live records, nothing else
    assert data[0].read_bytes() == b"".join(r for _, r in live)
    m = manifests[0]
    assert [e.key for e in m.entries] == [k for k, _ in live]  # the 4 deleted are not listed
    assert m.data_size == data[0].stat().st_size
    assert fl.stats.compacted_segments == 1 and fl.stats.flushed_segments == 1
    assert fl.stats.dead_bytes_dropped == fl.stats.flushed_bytes - m.data_size > 0
    got = await _restore(tmp_path / "obj", recs)
    assert [n is not None for n in got] == [r in live for r in recs]


async def test_records_superseded_after_the_seal_are_left_out(tmp_path: Path) -> None:
    ssd = await open_ssd_tier(tmp_path / "ssd")
    try:
        recs = _records(6, seed=2)
        await ssd.write_many([(k, memoryview(r)) for k, r in recs])
        assert await ssd.seal() is not None
        # after the seal: two records rewritten (their sealed copies are dead), one deleted
        await ssd.write_many([(k, memoryview(r)) for k, r in recs[:2]])
        assert await ssd.delete(recs[5][0])
        await _flush(ssd, tmp_path / "obj")  # the first segment; the open one is not sealed
    finally:
        await ssd.close()
    data, manifests = _bucket(tmp_path / "obj")
    assert len(data) == 1 and len(manifests) == 1
    assert data[0].read_bytes() == b"".join(r for _, r in recs[2:5])
    assert [e.key for e in manifests[0].entries] == [k for k, _ in recs[2:5]]


async def test_a_segment_within_the_dead_share_is_uploaded_as_it_is(tmp_path: Path) -> None:
    ssd = await open_ssd_tier(tmp_path / "ssd")
    try:
        recs = _records(10, seed=3)
        await ssd.write_many([(k, memoryview(r)) for k, r in recs])
        assert await ssd.delete(recs[3][0])
        seg = await ssd.seal()
        assert seg is not None
        file_bytes = Path(seg.path).read_bytes()
        fl = await _flush(ssd, tmp_path / "obj", compact_dead_share=1.0)  # never copy
    finally:
        await ssd.close()
    data, manifests = _bucket(tmp_path / "obj")
    assert data[0].read_bytes() == file_bytes  # the sealed file byte for byte, as before
    assert recs[3][0] not in {e.key for e in manifests[0].entries}
    assert len(manifests[0].entries) == 9
    assert fl.stats.compacted_segments == 0 and fl.stats.dead_bytes_dropped == 0
    got = await _restore(tmp_path / "obj", recs)
    assert [n is not None for n in got] == [i != 3 for i in range(10)]


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_dead_share_outside_0_1_is_refused(tmp_path: Path, share: float) -> None:
    tier = ObjectTier(LocalDirBackend(tmp_path / "obj"))
    with pytest.raises(ValueError, match="compact_dead_share"):
        Flusher(None, tier, compact_dead_share=share)  # type: ignore[arg-type]


class _ManifestFailsOnce(LocalDirBackend):
    """A bucket whose first manifest upload fails: the data object of a segment is stored and
    its manifest is not, as when a node stops between the two; the flusher redoes the upload."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failed = False

    async def put_object(self, name, source, *, if_absent=False):
        if "manifests/" in name and not self.failed:
            self.failed = True
            raise OSError("the node stopped before publishing the manifest")
        return await super().put_object(name, source, if_absent=if_absent)


async def test_a_redone_upload_of_the_same_live_records_reuses_its_data_object(tmp_path: Path) -> None:
    ssd = await open_ssd_tier(tmp_path / "ssd")
    backend = _ManifestFailsOnce(tmp_path / "obj")
    tier = ObjectTier(backend)
    try:
        recs = _records(8, seed=4)
        await ssd.write_many([(k, memoryview(r)) for k, r in recs])
        for k, _ in recs[::2]:
            assert await ssd.delete(k)
        assert await ssd.seal() is not None
        await tier.open()
        await tier.wait_ready()
        fl = Flusher(ssd, tier, scan_interval_s=0.05, retry_base_s=0.01)
        await fl.start()
        try:
            assert await fl.drain(timeout=30)
        finally:
            await fl.stop()
        assert backend.failed and fl.stats.failures == 1 and fl.stats.compacted_segments == 1
        assert tier.stats.objects_published == 1 and tier.stats.objects_deduplicated == 1  # the redo
    finally:
        await tier.close()
        await ssd.close()
    data, manifests = _bucket(tmp_path / "obj")
    assert len(data) == 1 and len(manifests) == 1  # content-addressed: one copy of the live records
    assert data[0].read_bytes() == b"".join(r for _, r in recs[1::2])


def test_the_live_copy_falls_back_to_reads_and_writes_without_copy_file_range(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from dynamo_tiered_kv.tiers.objectstore.flush import copy_live_records
    from dynamo_tiered_kv.tiers.segments import SegmentEntry

    blob = bytes(range(256)) * 64  # 16 KiB
    path = tmp_path / "seg"
    path.write_bytes(blob)
    keys = [random_key(i, b"copy") for i in range(3)]
    seg = SealedSegment("s/1", path, len(blob), (SegmentEntry(keys[0], 0, 4096), SegmentEntry(keys[1], 4096, 4096),
                                                  SegmentEntry(keys[2], 12288, 4096)), 0.0)

    def unsupported(*_args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    with open(tmp_path / "out", "w+b") as out:
        live = copy_live_records(seg, out.fileno())
        assert Path(live.path).read_bytes() == blob[:8192] + blob[12288:]
    assert [(e.key, e.offset, e.length) for e in live.entries] == [(keys[0], 0, 4096), (keys[1], 4096, 4096),
                                                                   (keys[2], 8192, 4096)]
    assert live.size == 12288 and live.segment_id == "s/1"


async def test_a_segment_whose_copy_cannot_be_made_is_uploaded_whole(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from dynamo_tiered_kv.tiers.objectstore import flush

    def disk_full(*_args: object) -> SealedSegment:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(flush, "copy_live_records", disk_full)
    ssd = await open_ssd_tier(tmp_path / "ssd")
    try:
        recs = _records(6, seed=5)
        await ssd.write_many([(k, memoryview(r)) for k, r in recs])
        for k, _ in recs[:3]:
            assert await ssd.delete(k)
        seg = await ssd.seal()
        assert seg is not None
        file_bytes = Path(seg.path).read_bytes()
        fl = await _flush(ssd, tmp_path / "obj")
        assert not ssd.unflushed_segments() and fl.stats.failures == 0
    finally:
        await ssd.close()
    data, manifests = _bucket(tmp_path / "obj")
    assert data[0].read_bytes() == file_bytes  # flushed all the same, dead bytes with it
    assert [e.key for e in manifests[0].entries] == [k for k, _ in recs[3:]]
    assert fl.stats.compacted_segments == 0
