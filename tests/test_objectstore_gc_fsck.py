"""Retention/GC and fsck of the object tier, and corrupt objects on the read path."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.cli import main as dtkv
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend
from dynamo_tiered_kv.tiers.objectstore.gc import gc_objects

pytest_plugins = ["infra.fixtures_s3"]


def _recs(base: int, n: int, layers: int = 2) -> list[tuple[bytes, bytes]]:
    shape = small_shape(num_layers=layers)
    return [(random_key(base + i, b"gc"), make_record(random_key(base + i, b"gc"), base + i, shape=shape))
            for i in range(n)]


async def _read(tier: ObjectTier, key: bytes, n: int) -> bytes | None:
    buf = bytearray(n)
    got = await tier.read_into(key, memoryview(buf))
    return None if got is None else bytes(buf)


async def test_gc_expires_manifests_then_deletes_data_after_grace(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    tier = ObjectTier(LocalDirBackend(root))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    old, new = _recs(0, 3), _recs(100, 3)
    await tier.write_many((k, memoryview(v)) for k, v in old)
    t_mid = time.time()
    time.sleep(0.01)
    await tier.write_many((k, memoryview(v)) for k, v in new)
    reader = ObjectTier(LocalDirBackend(root))  # another node that listed before the GC
    await reader.open()
    await reader.wait_ready()  # open() returns at once; the index builds in the background
    backend = LocalDirBackend(root)

    dry = await gc_objects(backend, ttl_s=10, grace_s=60, now=t_mid + 10, dry_run=True)
    assert dry.expired_manifests == 1 and dry.deleted_data == 0
    assert len(await backend.list("manifests/")) == 2

    rep = await gc_objects(backend, ttl_s=10, grace_s=60, now=t_mid + 10)
    assert (rep.manifests, rep.expired_manifests, rep.tombstoned, rep.deleted_data) == (2, 1, 1, 0)
    assert len(await backend.list("manifests/")) == 1 and len(await backend.list("data/")) == 2
    # Inside the grace period the stale reader still gets the right bytes.
    assert await _read(reader, old[0][0], len(old[0][1])) == old[0][1]
    fresh = ObjectTier(LocalDirBackend(root))
    await fresh.open()
    await fresh.wait_ready()  # open() returns at once; the index builds in the background
    assert not any(fresh.contains(k) for k, _ in old) and all(fresh.contains(k) for k, _ in new)

    again = await gc_objects(backend, ttl_s=None, grace_s=60, now=time.time() + 61)
    assert again.deleted_data == 1 and again.deleted_bytes > 0
    assert len(await backend.list("data/")) == 1 and await backend.list("tombstones/") == []
    # After deletion the stale reader sees a miss, never an error or wrong bytes.
    assert await _read(reader, old[1][0], len(old[1][1])) is None
    assert not reader.contains(old[2][0])  # the whole gone object was dropped from its index
    assert await _read(fresh, new[0][0], len(new[0][1])) == new[0][1]
    for t in (tier, reader, fresh):
        await t.close()


async def test_gc_collects_orphans_and_stale_uploads(tmp_path: Path, moto_s3: S3Server) -> None:
    backend = S3Backend(unique_bucket("gc"), "g/", **moto_s3.backend_kwargs())
    await backend.open()
    try:
        await backend.put_object("data/" + "ab" * 16 + ".seg", b"x" * 100)  # crash before its manifest
        await backend._client.create_multipart_upload(Bucket=backend.bucket, Key="g/data/unfinished.seg")
        rep = await gc_objects(backend, ttl_s=None, grace_s=0)
        assert rep.deleted_data == 1 and rep.aborted_uploads == 1
        assert await backend.list("") == []
    finally:
        await backend.close()


def test_gc_and_fsck_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    root = tmp_path / "obj"

    async def fill() -> list[tuple[bytes, bytes]]:
        tier = ObjectTier(LocalDirBackend(root))
        await tier.open()
        await tier.wait_ready()  # open() returns at once; the index builds in the background
        recs = _recs(200, 4)
        await tier.write_many((k, memoryview(v)) for k, v in recs)
        await tier.close()
        return recs

    recs = asyncio.run(fill())
    url = f"file://{root}"
    assert dtkv(["fsck", url, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["records_ok"] == 4 and rep["problems"] == []

    # Flip one payload byte of the third record: fsck names it.
    data = next((root / "data").iterdir())
    raw = bytearray(data.read_bytes())
    off = 2 * len(recs[0][1]) + 5000
    raw[off] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert dtkv(["fsck", url]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and recs[2][0].hex() in out and "ChecksumMismatch" in out

    assert dtkv(["gc", url, "--ttl", "0", "--grace", "0", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["expired_manifests"] == 1 and rep["deleted_data"] == 1
    assert [p for p in root.rglob("*") if p.is_file()] == []
    assert dtkv(["gc", "/not/a/url"]) == 2


async def test_corrupt_object_is_a_miss_never_served(tmp_path: Path, moto_s3: S3Server) -> None:
    bucket = unique_bucket("corrupt")
    tier = ObjectTier(S3Backend(bucket, **moto_s3.backend_kwargs()))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    recs = _recs(300, 3)
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    name, entry = tier.location(recs[1][0])
    raw = bytearray(b"".join(v for _, v in recs))
    raw[entry.offset + 4096 + 10] ^= 0x01  # one bit in the middle record's payload
    await tier.backend.put_object(name, raw)  # damaged at rest
    assert await _read(tier, recs[1][0], len(recs[1][1])) is None
    assert tier.stats.corrupt_reads == 1 and not tier.contains(recs[1][0])
    assert await _read(tier, recs[0][0], len(recs[0][1])) == recs[0][1]
    assert await _read(tier, recs[2][0], len(recs[2][1])) == recs[2][1]
    await tier.close()


async def test_damaged_manifest_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "obj"
    tier = ObjectTier(LocalDirBackend(root))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    recs = _recs(400, 2)
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    await tier.close()
    man = next((root / "manifests").iterdir())
    man.write_bytes(man.read_bytes().replace(b'"data_size":', b'"data_size":1'))
    again = ObjectTier(LocalDirBackend(root))
    await again.open()
    await again.wait_ready()  # open() returns at once; the index builds in the background
    assert again.usage().num_blocks == 0
    await again.close()


def test_fsck_command_checks_every_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tiers with a namespace write under ns/<hex>/: `dtkv fsck URL` must verify those records too."""
    import asyncio

    root = tmp_path / "obj"

    async def fill(ns: bytes, tag: int) -> list[tuple[bytes, bytes]]:
        tier = ObjectTier(LocalDirBackend(root), namespace=ns)
        await tier.open()
        await tier.wait_ready()
        recs = _recs(300 + tag, 3)
        await tier.write_many((k, memoryview(v)) for k, v in recs)
        await tier.close()
        return recs

    asyncio.run(fill(b"\x01" * 16, 0))
    recs = asyncio.run(fill(b"\x02" * 16, 1))
    assert dtkv(["fsck", f"file://{root}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records_ok"] == 6
    data = next(p for p in root.rglob("*") if p.is_file() and p.parent.name == "data"
                and ("02" * 16) in str(p))
    raw = bytearray(data.read_bytes())
    raw[len(recs[0][1]) + 5000] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert dtkv(["fsck", f"file://{root}"]) == 1
    assert recs[1][0].hex() in capsys.readouterr().out
