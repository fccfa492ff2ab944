"""ssd: SSD tier offload write / onboard read GB/s against raw O_DIRECT I/O in the same directory.

The same bytes (``--size`` of encoded records, ``--record-kib`` each, default a 2 MiB
Llama-3.1-8B 16-token block) are written and read four ways in one run, in ``--batch``-record
requests from page-aligned staging memory, as the store offloads and onboards prefixes:

* ``raw_write``: ``pwritev`` of each batch to one O_DIRECT file, ``fdatasync`` per batch;
* ``write``: ``SSDTier.write_many`` of each batch (segments, footers, index, fsync per batch);
* ``raw_read``: ``preadv`` of each batch from the raw file into a staging slab;
* ``read``: ``SSDTier.read_many`` of each batch into a staging slab.

Rounds interleave the four (``--repeats``, alternating whether the tier or the raw path goes
first) and the median of each is reported, so a noisy disk hits all of them alike;
``rounds_gbps`` lists every round. GB/s is 10^9 bytes
per second. Files are removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..blocks.codec import encode_payload, header_bytes, record_bytes
from ..blocks.keys import KEY_BYTES
from ..blocks.layout import BlockShape, CanonicalFormat, DType
from ..config.sizes import size_arg
from ..tiers.base import ReadRequest
from ..tiers.ssd import SSDTier
from ..tiers.ssd.io import aligned_buffer
from . import report
from ._keys import random_key

NAMESPACE = bytes(range(KEY_BYTES))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, type=Path, help="directory on the device to measure")
    p.add_argument("--size", type=size_arg, default=1 << 30, help="bytes per pass, e.g. 1GiB (default), 512Mi, 2GB")
    p.add_argument("--record-kib", type=int, default=2048, help="payload KiB per record (2048: 8B-model block)")
    p.add_argument("--batch", type=int, default=16, help="records per write_many/read_many (one prefix run)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median of each path is reported")
    p.add_argument("--io", default="auto", choices=["auto", "nixl", "odirect", "buffered"],
                   help="SSD tier I/O path (auto: NIXL when it loads, else O_DIRECT)")
    p.add_argument("--segment-mib", type=int, default=256, help="segment file size")
    p.add_argument("--no-fsync", action="store_true", help="no fdatasync per batch (tier and raw alike)")


def _shape(record_kib: int) -> BlockShape:
    # one layer per 64 KiB of bf16 K+V (16 tokens x 8 heads x 128 dims x 2 planes x 2 bytes)
    layers = max(1, record_kib // 64)
    return BlockShape(CanonicalFormat.KV_SPLIT, DType.BFLOAT16, layers, 16, 8, 128)


def run(args: argparse.Namespace) -> dict:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> dict:
    shape = _shape(args.record_kib)
    rb = record_bytes(shape)
    n = max(args.batch, args.size // rb // args.batch * args.batch)
    total = n * rb
    src = aligned_buffer(total)
    payload = np.random.default_rng(0).integers(0, 256, shape.payload_bytes, dtype=np.uint8)
    keys = [random_key(i, b"bench-ssd") for i in range(n)]
    for i, k in enumerate(keys):
        payload[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)  # distinct records
        encode_payload(payload, shape, NAMESPACE, k, bytes(KEY_BYTES), src[i * rb:(i + 1) * rb])
    dst = aligned_buffer(args.batch * rb)
    batches = [range(j, j + args.batch) for j in range(0, n, args.batch)]
    work = args.dir / f"dtkv-bench-ssd-{os.getpid()}"
    work.mkdir(parents=True)
    fsync = not args.no_fsync
    times: dict[str, list[float]] = {k: [] for k in ("raw_write", "write", "raw_read", "read")}
    io_path = ""
    report.progress("ssd", f"{total / 2**20:.0f} MiB per pass in {len(batches)} requests of {args.batch} records, "
                    f"{args.repeats} rounds of tier and raw write + read in {args.dir}")
    steps = report.Steps("ssd", args.repeats)
    try:
        for rnd in range(args.repeats):
            raw = work / "raw.bin"
            tier_first = rnd % 2 == 1  # alternate who goes first, so drift in the device hits both
            if not tier_first:
                times["raw_write"].append(_raw_write(raw, src, batches, rb, fsync))
            tier_dir = work / f"tier{rnd}"
            tier = SSDTier(tier_dir, capacity_bytes=total * 2 + (64 << 20), segment_bytes=args.segment_mib << 20,
                           io=args.io, fsync=fsync, idle_seal_s=None)
            await tier.open()
            if not tier.available:
                raise SystemExit(f"SSD tier unavailable: {tier.disabled_reason}")
            io_path = tier.io_path
            try:
                t0 = time.perf_counter()
                for b in batches:
                    await tier.write_many((keys[i], src[i * rb:(i + 1) * rb]) for i in b)
                await tier.seal()
                times["write"].append(time.perf_counter() - t0)
                if tier_first:
                    times["raw_write"].append(_raw_write(raw, src, batches, rb, fsync))
                else:
                    times["raw_read"].append(_raw_read(raw, dst, batches, rb))
                t0 = time.perf_counter()
                for b in batches:
                    reqs = [ReadRequest(keys[i], memoryview(dst[j * rb:(j + 1) * rb])) for j, i in enumerate(b)]
                    got = await tier.read_many(reqs)
                    if None in got:
                        raise RuntimeError("SSD tier lost a record during the benchmark")
                times["read"].append(time.perf_counter() - t0)
                if tier_first:
                    times["raw_read"].append(_raw_read(raw, dst, batches, rb))
                last = batches[-1]
                if not np.array_equal(dst[:len(last) * rb], src[last[0] * rb:(last[-1] + 1) * rb]):
                    raise RuntimeError("SSD tier read back different bytes")
            finally:
                await tier.close()
                shutil.rmtree(tier_dir, ignore_errors=True)
            raw.unlink()
            steps.step(f"round: write {total / times['write'][-1] / 1e9:.2f} GB/s, "
                       f"read {total / times['read'][-1] / 1e9:.2f} GB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gbps = {k: total / float(np.median(v)) / 1e9 for k, v in times.items()}
    return {
        "write_gbps": gbps["write"], "read_gbps": gbps["read"],
        "raw_write_gbps": gbps["raw_write"], "raw_read_gbps": gbps["raw_read"],
        "write_ratio": gbps["write"] / gbps["raw_write"], "read_ratio": gbps["read"] / gbps["raw_read"],
        "bytes": total, "record_bytes": rb, "header_bytes": header_bytes(shape.num_layers),
        "batch_records": args.batch, "repeats": args.repeats, "io_path": io_path, "fsync": fsync,
        "segment_bytes": args.segment_mib << 20, "dir": str(args.dir),
        "rounds_gbps": {k: [round(total / t / 1e9, 3) for t in v] for k, v in times.items()},
    }


def format_result(res: dict) -> str:
    rows = [["write (write_many + seal)", res["write_gbps"], res["raw_write_gbps"], res["write_ratio"]],
            ["read (read_many)", res["read_gbps"], res["raw_read_gbps"], res["read_ratio"]]]
    title = (f"ssd: {res['dir']}, I/O path {res['io_path']}, {res['bytes'] / 2**20:.0f} MiB per pass, "
             f"{res['record_bytes'] / 2**10:.0f} KiB records x {res['batch_records']} per request, "
             f"fsync {'on' if res['fsync'] else 'off'}; median of {res['repeats']} rounds (GB/s = 10^9 bytes/s)")
    return report.table(["path", "tier GB/s", "raw O_DIRECT GB/s", "ratio"], rows, title=title,
                        fmts=["", ".2f", ".2f", ".2f"])


def _raw_write(path: Path, src: np.ndarray, batches: list[range], rb: int, fsync: bool) -> float:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        t0 = time.perf_counter()
        for b in batches:
            chunk = src[b[0] * rb:(b[-1] + 1) * rb]
            if os.pwritev(fd, [chunk], b[0] * rb) != chunk.nbytes:
                raise OSError("short raw write")
            if fsync:
                os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _raw_read(path: Path, dst: np.ndarray, batches: list[range], rb: int) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for b in batches:
            chunk = dst[:len(b) * rb]
            if os.preadv(fd, [chunk], b[0] * rb) != chunk.nbytes:
                raise OSError("short raw read")
        return time.perf_counter() - t0
    finally:
        os.close(fd)
