"""s3: object tier flush (multipart PUT) and prefix restore (ranged GET) against raw aiobotocore.

One sealed segment (``--segment-mib`` of encoded records, ``--record-kib`` each, split into
``--prefixes`` sequences stored back to back) is moved four ways per round, against the same
server and bucket in the same run:

* ``put``: ``ObjectTier.publish_segment`` (content digest, parallel multipart PUT read part by
  part from the segment file, manifest);
* ``raw_put``: aiobotocore multipart PUT of the same bytes from memory, same part size and
  parallelism;
* ``get``: ``ObjectTier.read_many`` of each prefix into a staging slab (one ranged GET per
  contiguous run, records verified); ``gets_per_prefix`` counts the GETs it issued;
* ``raw_get``: one aiobotocore ranged GET per prefix, body read into bytes.

Every path uses its own long-lived client. A first, unreported round warms connections and
server-side pools; then ``--repeats`` rounds interleave the paths (PUTs alternate per round,
GETs per prefix, swapping which goes first); throughputs are medians over rounds and ratios
are medians of each round's paired ratio;
GB/s is 10^9 bytes per second. Without ``--endpoint`` a moto server is started on loopback in
a separate process. Objects written by the benchmark are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ..blocks.codec import encode_payload, record_bytes
from ..blocks.keys import KEY_BYTES, ROOT_KEY
from ..blocks.layout import BlockShape, CanonicalFormat, DType
from ..staging.slabs import StagingPool
from ..tiers.base import ReadRequest
from ..tiers.objectstore import ObjectTier, S3Backend
from ..tiers.segments import SealedSegment, SegmentEntry
from . import report
from ._keys import random_key

NAMESPACE = bytes(range(KEY_BYTES))


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ
    p.add_argument("--endpoint", default=env.get("DTKV_S3_ENDPOINT"),
                   help="S3 endpoint URL (default: start a moto server on loopback)")
    p.add_argument("--bucket", default="dtkv-bench", help="bucket (created if missing)")
    p.add_argument("--access-key", default=env.get("DTKV_S3_ACCESS_KEY", "testing"), help="S3 access key")
    p.add_argument("--secret-key", default=env.get("DTKV_S3_SECRET_KEY", "testing"), help="S3 secret key")
    p.add_argument("--region", default=env.get("DTKV_S3_REGION", "us-east-1"), help="S3 region")
    p.add_argument("--segment-mib", type=int, default=64, help="segment (object) size")
    p.add_argument("--record-kib", type=int, default=2048, help="record payload KiB (2048: 8B-model block)")
    p.add_argument("--prefixes", type=int, default=4, help="sequences per segment, each restored as a prefix")
    p.add_argument("--part-mib", type=int, default=8, help="multipart part size")
    p.add_argument("--concurrency", type=int, default=8, help="parts in flight")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported")


def _shape(record_kib: int) -> BlockShape:
    return BlockShape(CanonicalFormat.KV_SPLIT, DType.BFLOAT16, max(1, record_kib // 64), 16, 8, 128)


def _make_segment(path: Path, shape: BlockShape, n: int, prefixes: int) -> SealedSegment:
    rb = record_bytes(shape)
    rng = np.random.default_rng(0)
    buf = np.zeros(rb, np.uint8)
    entries = []
    per = max(1, n // prefixes)
    with open(path, "wb") as f:
        parent = ROOT_KEY
        for i in range(n):
            key = random_key(i, b"bench-s3")
            if i % per == 0:
                parent = ROOT_KEY
            encode_payload(rng.integers(0, 256, shape.payload_bytes, dtype=np.uint8), shape, NAMESPACE, key,
                           parent, buf)
            f.write(buf.tobytes())
            entries.append(SegmentEntry(key, i * rb, rb))
            parent = key
        f.write(b"\0" * 4096)  # footer stand-in
    return SealedSegment("bench/0", path, n * rb + 4096, tuple(entries), time.time())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


async def _raw_put(client: Any, bucket: str, key: str, data: bytes, part: int, conc: int) -> None:
    up = await client.create_multipart_upload(Bucket=bucket, Key=key)
    sem = asyncio.Semaphore(conc)
    view = memoryview(data)

    async def one(i: int) -> dict[str, Any]:
        async with sem:
            r = await client.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=i + 1,
                                         Body=bytes(view[i * part:(i + 1) * part]))
            return {"ETag": r["ETag"], "PartNumber": i + 1}

    parts = await asyncio.gather(*(one(i) for i in range(-(-len(data) // part))))
    await client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                           MultipartUpload={"Parts": list(parts)})


async def _raw_get(client: Any, bucket: str, key: str, start: int, length: int) -> int:
    r = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")
    async with r["Body"] as body:
        data = await body.read()
    if len(data) != length:
        raise RuntimeError(f"raw GET returned {len(data)} of {length} bytes")
    return len(data)


async def _run(args: argparse.Namespace, endpoint: str, work: Path) -> dict[str, Any]:
    shape = _shape(args.record_kib)
    rb = record_bytes(shape)
    n = max(args.prefixes, (args.segment_mib << 20) // rb)
    seg = _make_segment(work / "segment.seg", shape, n, args.prefixes)
    data = seg.path.read_bytes()
    per = max(1, n // args.prefixes)
    prefixes = [seg.entries[i:i + per] for i in range(0, n, per)][: args.prefixes]
    root = f"dtkv-bench/{uuid.uuid4().hex[:8]}/"
    kw: dict[str, Any] = {"endpoint_url": endpoint, "region": args.region, "access_key": args.access_key,
                          "secret_key": args.secret_key, "part_bytes": args.part_mib << 20,
                          "max_concurrency": args.concurrency}
    # Long-lived clients for every path (as a flusher's would be): the raw path uses one, the
    # writing node and the reading node one each.
    setup = S3Backend(args.bucket, root, create_bucket=True, **kw)
    writer = S3Backend(args.bucket, root + "tier/", **kw)
    reader_backend = S3Backend(args.bucket, root + "tier/", **kw)
    for b in (setup, writer, reader_backend):
        await b.open()
    client = setup._client  # the raw path: plain aiobotocore calls, no tier code
    raw_key = root + "raw/segment"
    pool = StagingPool(per * rb, 1)
    res: dict[str, list[float]] = {"put": [], "raw_put": [], "get": [], "raw_get": []}
    gets = restored = 0
    report.progress("s3", f"{endpoint}: {seg.size / 2**20:.0f} MiB segment, {len(prefixes)} prefixes of {per} "
                    f"records; 1 warm-up + {args.repeats} rounds of put and ranged get, tier and raw")
    steps = report.Steps("s3", args.repeats + 1)
    try:
        for rnd in range(args.repeats + 1):  # round 0 warms connections and server pools: not reported
            tier = ObjectTier(writer)
            await tier.refresh()
            times = {}
            for path in (("put", "raw_put") if rnd % 2 == 0 else ("raw_put", "put")):
                t = time.perf_counter()
                if path == "put":
                    await tier.publish_segment(seg)
                else:
                    await _raw_put(client, args.bucket, raw_key, data, args.part_mib << 20, args.concurrency)
                times[path] = time.perf_counter() - t
            reader = ObjectTier(reader_backend)
            await reader.refresh()  # a node with no local state: index from the manifest
            t_get = t_raw = 0.0
            nbytes = 0
            with pool.slab() as slab:
                # Prefix by prefix, tier and raw back to back (alternating which goes first), so
                # both see the same server state; each path's time is summed over the prefixes.
                for i, p in enumerate(prefixes):
                    length = p[-1].offset + p[-1].length - p[0].offset
                    reqs, off = [], 0
                    for e in p:
                        reqs.append(ReadRequest(e.key, slab.view[off:off + e.length]))
                        off += e.length
                    for path in (("get", "raw") if (rnd + i) % 2 == 0 else ("raw", "get")):
                        t = time.perf_counter()
                        if path == "get":
                            before = reader.stats.gets
                            got = await reader.read_many(reqs)
                            t_get += time.perf_counter() - t
                            if any(g != e.length for g, e in zip(got, p)):
                                raise RuntimeError("object tier restore missed records")
                            if rnd:
                                gets += reader.stats.gets - before
                                restored += 1
                        else:
                            await _raw_get(client, args.bucket, raw_key, p[0].offset, length)
                            t_raw += time.perf_counter() - t
                    nbytes += length
            for o in await setup.list(""):  # the next round uploads for real again
                await setup.delete(o.name)
            if rnd:
                res["put"].append(seg.size / times["put"] / 1e9)
                res["raw_put"].append(len(data) / times["raw_put"] / 1e9)
                res["get"].append(nbytes / t_get / 1e9)
                res["raw_get"].append(nbytes / t_raw / 1e9)
            steps.step("warm-up" if rnd == 0 else f"round {rnd}: put {res['put'][-1]:.3f} GB/s, "
                       f"get {res['get'][-1]:.3f} GB/s")
    finally:
        pool.close()
        for o in await setup.list(""):
            await setup.delete(o.name)
        for b in (setup, writer, reader_backend):
            await b.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "endpoint": endpoint,
        "segment_bytes": seg.size,
        "record_bytes": rb,
        "records_per_prefix": per,
        "prefixes": len(prefixes),
        "part_bytes": args.part_mib << 20,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "put_gbps": med["put"],
        "raw_put_gbps": med["raw_put"],
        # median of per-round ratios: each round's two paths ran back to back, so a noisy
        # neighbour slows both alike (more robust than a ratio of medians on a shared host)
        "put_ratio": statistics.median(a / b for a, b in zip(res["put"], res["raw_put"])),
        "get_gbps": med["get"],
        "raw_get_gbps": med["raw_get"],
        "get_ratio": statistics.median(a / b for a, b in zip(res["get"], res["raw_get"])),
        "gets_per_prefix": gets / max(1, restored),
        "rounds_gbps": {k: [round(x, 4) for x in v] for k, v in res.items()},
    }


def format_result(res: dict[str, Any]) -> str:
    rows = [["put (publish_segment)", res["put_gbps"], "multipart upload", res["raw_put_gbps"], res["put_ratio"]],
            ["get (read_many of a prefix)", res["get_gbps"], "one ranged GET", res["raw_get_gbps"], res["get_ratio"]]]
    title = (f"s3: {res['endpoint']} ({res['server']}), {res['segment_bytes'] / 2**20:.0f} MiB segment, "
             f"{res['prefixes']} prefixes x {res['records_per_prefix']} records, {res['gets_per_prefix']:.1f} GETs "
             f"per prefix; medians of {res['repeats']} rounds (ratio: median of per-round ratios)")
    return report.table(["path", "GB/s", "raw", "GB/s", "ratio"], rows, title=title,
                        fmts=["", ".3f", "", ".3f", ".2f"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    moto = None
    endpoint = args.endpoint
    if not endpoint:
        moto, endpoint = _start_moto()
    try:
        with tempfile.TemporaryDirectory(prefix="dtkv-bench-s3-") as d:
            out = asyncio.run(_run(args, endpoint, Path(d)))
            out["server"] = "moto (local process)" if moto is not None else "given endpoint"
            return out
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
