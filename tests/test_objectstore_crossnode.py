"""Cross-node sharing: another process with an empty SSD, pointed at the same bucket, restores
what this one flushed; a flusher killed with SIGKILL mid-upload leaves nothing visible."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, unique_bucket
from infra.segments_fake import FakeSegmentSource

from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher

pytest_plugins = ["infra.fixtures_s3"]
NODE = Path(__file__).parent / "infra" / "objnode.py"


@pytest.fixture(params=["moto_s3", pytest.param("ceph_s3", marks=pytest.mark.s3), "localdir"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict, S3Server | None]:
    """(url, S3Backend kwargs for the child, server) for one shared store."""
    if request.param == "localdir":
        return f"file://{tmp_path / 'shared'}", {}, None
    server: S3Server = request.getfixturevalue(request.param)
    kw = {"endpoint_url": server.endpoint, "access_key": server.access_key, "secret_key": server.secret_key}
    return f"s3://{unique_bucket('xnode')}/shared/", kw, server


def _backend(url: str, kw: dict) -> LocalDirBackend | S3Backend:
    if url.startswith("file://"):
        return LocalDirBackend(url[len("file://"):])
    bucket, prefix = url[len("s3://"):].split("/", 1)
    return S3Backend(bucket, prefix, create_bucket=True, **kw)


async def _node(cmd: str, args: dict, env: dict | None = None) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(NODE), cmd, json.dumps(args), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_second_process_restores_what_this_one_flushed(tmp_path: Path, store) -> None:
    url, kw, _server = store
    src = FakeSegmentSource(tmp_path / "ssd-a")
    made = [src.add_segment(12, seed=70 + i) for i in range(3)]
    tier = ObjectTier(_backend(url, kw))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    fl = Flusher(src, tier, scan_interval_s=0.05)
    await fl.start()
    try:
        assert await fl.drain(timeout=60)
    finally:
        await fl.stop()
        await tier.close()

    # Node B: another process, empty local state, same bucket. Ask for each sequence's prefix
    # plus one key nobody stored (the prefix stops there).
    missing = hashlib.blake2b(b"nobody", digest_size=16).hexdigest()
    prefixes = [[e.key.hex() for e in seg.entries[:9]] + [missing] for seg, _ in made]
    rep = await _node("restore", {"url": url, "s3": kw, "prefixes": prefixes})
    assert rep["blocks_indexed"] == 36
    for p, (_seg, recs) in zip(rep["prefixes"], made):
        assert p["restored"] == 9 and p["ok"] and p["gets"] == 1  # one ranged GET per prefix
        assert p["sha256"] == [hashlib.sha256(r).hexdigest() for r in recs[:9]]


async def test_sigkill_mid_upload_leaves_nothing_visible(tmp_path: Path, moto_s3: S3Server) -> None:
    host, port = moto_s3.endpoint.rsplit("//", 1)[1].split(":")
    proxy = await FaultProxy(host, int(port)).start()
    bucket = unique_bucket("kill")
    setup = S3Backend(bucket, **moto_s3.backend_kwargs())
    await setup.open()
    await setup.close()
    src = FakeSegmentSource(tmp_path / "ssd")
    seg, recs = src.add_segment(90, seed=80, num_layers=32)  # ~12 MiB: multipart
    kw = {"endpoint_url": proxy.endpoint, "access_key": "testing", "secret_key": "testing", "part_bytes": 5 << 20}
    proxy.delay_s = 1.0
    proxy.set_mode("delay")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(NODE), "flush", json.dumps({"url": f"s3://{bucket}/k/", "s3": kw, "ssd": str(src.root)}),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)  # type: ignore[union-attr]
        assert json.loads(line)["started"]
        for _ in range(200):
            if proxy.connections >= 3:  # list + create upload + parts under way
                break
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    proxy.set_mode("pass")
    proxy.sever()
    kw["endpoint_url"] = moto_s3.endpoint
    direct = S3Backend(bucket, "k/", **kw)
    await direct.open()
    try:
        assert await direct.list("") == []  # no object, no manifest: an unfinished upload is invisible
        assert not FakeSegmentSource(src.root).is_flushed(seg.segment_id)
    finally:
        await direct.close()
    # Restart: this process resumes the flush from the SSD side's durable progress.
    tier = ObjectTier(S3Backend(bucket, "k/", **kw))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    fl = Flusher(FakeSegmentSource(src.root), tier, scan_interval_s=0.05)
    await fl.start()
    try:
        assert await fl.drain(timeout=60)
        buf = bytearray(seg.entries[5].length)
        assert await tier.read_into(seg.entries[5].key, memoryview(buf)) == len(buf)
        assert bytes(buf) == recs[5]
    finally:
        await fl.stop()
        await tier.close()
        await proxy.stop()
