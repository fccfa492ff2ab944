"""Shared-bucket safety: a node's failed read never deletes shared data (quarantine instead),
writes never drop other nodes' copies, publishing wins against a concurrent GC, and verifying
reads check the namespace."""

from __future__ import annotations

import time
from pathlib import Path

from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.testing.records import TEST_NAMESPACE
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.backend import Source
from dynamo_tiered_kv.tiers.objectstore.gc import gc_objects
from dynamo_tiered_kv.tiers.objectstore.manifest import MANIFEST_DIR, TOMBSTONE_DIR
from dynamo_tiered_kv.tiers.objectstore.quarantine import QUARANTINE_DIR

SHAPE = small_shape(num_layers=2)


def _recs(base: int, n: int, namespace: bytes = TEST_NAMESPACE) -> list[tuple[bytes, bytes]]:
    return [(random_key(base + i, b"q"), make_record(random_key(base + i, b"q"), base + i, shape=SHAPE,
                                                     namespace=namespace)) for i in range(n)]


async def _read(tier: ObjectTier, key: bytes, n: int) -> bytes | None:
    buf = bytearray(n)
    got = await tier.read_into(key, memoryview(buf))
    return None if got is None else bytes(buf)


async def _open(root: Path, **kw: object) -> ObjectTier:
    t = ObjectTier(LocalDirBackend(root), **kw)  # type: ignore[arg-type]
    await t.open()
    await t.wait_ready()  # open() returns at once; the index builds in the background
    return t


def _names(root: Path, sub: str) -> list[str]:
    d = root / sub
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# --- item 9: one node's failed read must not delete shared data ----------------------------------

async def test_failed_verification_on_one_node_keeps_the_key_for_others(tmp_path: Path) -> None:
    """What the store does after a transient bad read (``_forget`` -> ``delete``) stays local."""
    root = tmp_path / "obj"
    a, b = await _open(root), await _open(root)
    recs = _recs(0, 3)
    await a.write_many((k, memoryview(v)) for k, v in recs)
    await b.refresh()
    manifests = _names(root, "manifests")
    assert await b.delete(recs[1][0]) is True  # b's load of it failed verification (in transit)
    assert not b.contains(recs[1][0])  # b stops offering it ...
    assert _names(root, "manifests") == manifests  # ... but the bucket is untouched
    assert _names(root, "quarantine") == []  # the re-read verified: nothing to report
    await a.refresh()
    fresh = await _open(root)
    for t in (a, fresh):
        assert t.contains(recs[1][0])
        assert await _read(t, recs[1][0], len(recs[1][1])) == recs[1][1]
    await b.refresh()
    assert not b.contains(recs[1][0])  # b's exclusion survives its refreshes
    for t in (a, b, fresh):
        await t.close()


async def test_corrupt_at_rest_is_quarantined_then_gc_drops_only_that_record(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    a = await _open(root, verify_reads=True)
    recs = _recs(10, 3)
    await a.write_many((k, memoryview(v)) for k, v in recs)
    name, entry = a.location(recs[1][0])
    path = root / name
    raw = bytearray(path.read_bytes())
    raw[entry.offset + 4096 + 10] ^= 0x01
    path.write_bytes(raw)
    other = await _open(root)
    assert await _read(a, recs[1][0], len(recs[1][1])) is None  # failed twice: a miss
    await a.close()  # waits for the marker write
    assert a.stats.corrupt_reads == 1 and a.stats.quarantined == 1
    assert len(_names(root, "quarantine")) == 1
    await other.refresh()
    assert other.contains(recs[1][0])  # nothing shared changed until gc decides
    rep = await gc_objects(LocalDirBackend(root), ttl_s=None)
    assert rep.quarantine_dropped == 1 and rep.quarantine_cleared == 0
    assert _names(root, "quarantine") == []
    await other.refresh()
    assert not other.contains(recs[1][0])
    for k, v in (recs[0], recs[2]):
        assert await _read(other, k, len(v)) == v
    await other.close()


async def test_gc_clears_a_marker_whose_record_verifies(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    a = await _open(root)
    recs = _recs(20, 2)
    await a.write_many((k, memoryview(v)) for k, v in recs)
    name, entry = a.location(recs[0][0])
    from dynamo_tiered_kv.tiers.objectstore.quarantine import new_marker, write_marker

    await write_marker(a.backend, new_marker(name, entry.offset, entry.length, recs[0][0], "test", "t"))
    manifests = _names(root, "manifests")
    rep = await gc_objects(a.backend, ttl_s=None)
    assert rep.quarantine_cleared == 1 and rep.quarantine_dropped == 0
    assert _names(root, "quarantine") == [] and _names(root, "manifests") == manifests
    await a.close()


async def test_in_flight_corruption_is_reread_and_served(tmp_path: Path) -> None:
    """A flipped bit on the first read only: the re-read verifies, the record is served."""
    root = tmp_path / "obj"
    t = await _open(root, verify_reads=True)
    recs = _recs(30, 2)
    await t.write_many((k, memoryview(v)) for k, v in recs)
    backend = t.backend
    real = backend.get_range
    calls = {"n": 0}

    async def flaky(name: str, offset: int, dests):  # type: ignore[no-untyped-def]
        n = await real(name, offset, dests)
        calls["n"] += 1
        if calls["n"] == 1:
            dests[0][5000] ^= 0xFF
        return n

    backend.get_range = flaky  # type: ignore[method-assign]
    assert await _read(t, recs[0][0], len(recs[0][1])) == recs[0][1]
    assert t.stats.reread_ok == 1 and t.stats.corrupt_reads == 0 and t.contains(recs[0][0])
    await t.close()
    assert _names(root, "quarantine") == []


async def test_write_many_keeps_other_nodes_copies(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    a, b = await _open(root), await _open(root)
    recs = _recs(40, 3)
    await a.write_many((k, memoryview(v)) for k, v in recs)
    manifests = _names(root, "manifests")
    await b.refresh()
    k = recs[1][0]
    newer = make_record(k, 999, shape=SHAPE)
    await b.write_many([(k, memoryview(newer))])  # b stores its own copy of one of a's keys
    assert set(manifests) <= set(_names(root, "manifests"))  # a's manifest is untouched
    assert await _read(b, k, len(newer)) == newer  # newest wins
    fresh = await _open(root)
    assert await _read(fresh, k, len(newer)) == newer
    for kk, vv in (recs[0], recs[2]):
        assert await _read(fresh, kk, len(vv)) == vv
    for t in (a, b, fresh):
        await t.close()


# --- item 10: publish-dedup vs GC ----------------------------------------------------------------

class _GcBeforeManifest(LocalDirBackend):
    """Runs a GC pass between the data put and the manifest put of the next publish."""

    def __init__(self, root: Path, *, grace_s: float, now: float | None) -> None:
        super().__init__(root)
        self.gc_args = {"grace_s": grace_s, "now": now}
        self.armed = True
        self.gc_report = None

    async def put_object(self, name: str, source: Source, *, if_absent: bool = False) -> bool:
        if self.armed and name.startswith(MANIFEST_DIR):
            self.armed = False
            self.gc_report = await gc_objects(LocalDirBackend(self.root), ttl_s=None, **self.gc_args)
        return await super().put_object(name, source, if_absent=if_absent)


async def _orphan_tombstoned(root: Path, recs: list[tuple[bytes, bytes]]) -> None:
    """A published run whose manifest is gone (expired/evicted) and whose data gc tombstoned."""
    a = await _open(root)
    await a.write_many((k, memoryview(v)) for k, v in recs)
    await a.close()
    for p in (root / "manifests").iterdir():
        p.unlink()
    rep = await gc_objects(LocalDirBackend(root), ttl_s=None, grace_s=3600)
    assert rep.tombstoned == 1 and len(_names(root, "tombstones")) == 1


async def test_dedup_publish_of_tombstoned_data_survives_gc_in_between(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    recs = _recs(50, 3)
    await _orphan_tombstoned(root, recs)
    # gc runs with the tombstone long ripe, after the data put found the object, before the manifest
    backend = _GcBeforeManifest(root, grace_s=3600, now=time.time() + 7200)
    pub = ObjectTier(backend)
    await pub.open()
    await pub.write_many((k, memoryview(v)) for k, v in recs)
    assert pub.stats.objects_deduplicated == 1
    assert backend.gc_report is not None and backend.gc_report.deleted_data == 0
    name, _ = pub.location(recs[0][0])
    assert (root / name).exists()
    await pub.close()
    reader = await _open(root)
    for k, v in recs:
        assert await _read(reader, k, len(v)) == v
    await reader.close()
    # later gc runs see the manifest: the data stays
    await gc_objects(LocalDirBackend(root), ttl_s=None, grace_s=0)
    assert (root / name).exists() and _names(root, TOMBSTONE_DIR.rstrip("/")) == []


async def test_publish_reuploads_data_that_gc_deleted_before_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    recs = _recs(60, 2)
    backend = _GcBeforeManifest(root, grace_s=0, now=None)  # no grace: gc deletes the fresh orphan
    pub = ObjectTier(backend)
    await pub.open()
    await pub.write_many((k, memoryview(v)) for k, v in recs)
    assert backend.gc_report is not None and backend.gc_report.deleted_data == 1  # the race happened
    await pub.close()
    reader = await _open(root)
    for k, v in recs:
        assert await _read(reader, k, len(v)) == v
    await reader.close()
    assert pub.stats.reuploaded_objects == 1


# --- item 5: namespace-aware verification ---------------------------------------------------------

async def test_verifying_reads_reject_a_foreign_namespace(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    foreign_ns = bytes(16)
    writer = await _open(root)
    recs = _recs(70, 2, namespace=foreign_ns)  # same key bytes, another tenant's namespace
    await writer.write_many((k, memoryview(v)) for k, v in recs)
    await writer.close()
    mine = await _open(root, verify_reads=True, namespace=TEST_NAMESPACE)
    assert await _read(mine, recs[0][0], len(recs[0][1])) is None
    assert mine.stats.corrupt_reads == 1
    theirs = await _open(root, verify_reads=True, namespace=foreign_ns)
    assert await _read(theirs, recs[0][0], len(recs[0][1])) == recs[0][1]
    for t in (mine, theirs):
        await t.close()
    assert _names(root, QUARANTINE_DIR.rstrip("/")) == []  # a foreign record is not corrupt
