"""restore_store: TieredStore.load of N blocks per tier against the raw read of the same bytes.

Per tier, in one process and interleaved round by round (so device and cache drift hit both):
``host``: load from the host tier vs one memcpy of the same payload bytes. ``ssd``: load from SSD
segments in ``--dir`` (host tier off) vs O_DIRECT preadv of the same segment bytes, ``--qd``
reads of ``--piece-mib`` in flight. ``objdir``: object tier on a local directory vs parallel
preads of the data objects, both from a cold page cache (the objects are dropped from it with
POSIX_FADV_DONTNEED before every load and raw read). ``s3``: object tier on S3 (``--s3-endpoint``/``DTKV_S3_ENDPOINT``,
else an in-process moto server) vs parallel ranged GETs (``s3_read_concurrency`` in flight).
Each row: best and median load/raw ratio, and the load's stage breakdown (``LoadResult.stages``);
object tiers also the requests their backend sent per GB restored (measured loads only).

HDD mode (``--osd-op-delay-ms 8``, ``s3`` on a local Ceph RGW): every OSD op waits that long while
the s3 tier's rounds run (``osd_delay``), as on one spindle that seeks once per op.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..blocks.codec import record_bytes
from ..blocks.keys import Namespace, chain_keys, parents_of
from ..blocks.layout import EngineLayout
from ..config import TieredKVConfig
from ..factory import build_store
from ..tiers.ssd.io import aligned_buffer
from . import osd_delay
from ._shapes import BLOCK_TOKENS, SHAPES, flash_layout
from .report import progress, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiers", default="host,ssd,objdir", help="comma list of host, ssd, objdir, s3")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2-7b-ish", help="layers, KV heads, head size")
    p.add_argument("--blocks", type=int, default=504, help="blocks restored per load (504 x 128 KiB = 63 MiB)")
    p.add_argument("--dir", default=None, help="directory on the SSD under test (default: a temp dir)")
    p.add_argument("--qd", type=int, default=4, help="raw SSD reads in flight")
    p.add_argument("--piece-mib", type=int, default=8, help="raw read size")
    p.add_argument("--ssd-io", choices=["auto", "nixl", "odirect"], default="auto", help="SSD tier I/O path")
    p.add_argument("--s3-endpoint", default=os.environ.get("DTKV_S3_ENDPOINT"),
                   help="S3 server for the s3 tier (default $DTKV_S3_ENDPOINT, else a moto server)")
    p.add_argument("--s3-concurrency", type=int, default=8,
                   help="ranged GETs in flight, ours and the plain reads (s3_read_concurrency)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds of load and raw read")
    osd_delay.add_arguments(p)


def _progress(msg: str) -> None:
    progress("restore_store", msg)


def _layout(shape: str, n: int) -> tuple[EngineLayout, Namespace, list[bytes]]:
    layout, ns = flash_layout(shape, n, name=f"bench-{shape}")
    return layout, ns, chain_keys(ns, np.arange(n * BLOCK_TOKENS) % 50000)


BUCKET = os.environ.get("DTKV_S3_BUCKET", "dtkv-bench")


async def _make_bucket(endpoint: str) -> None:
    from ..tiers.objectstore.s3 import S3Backend

    b = S3Backend(BUCKET, "", endpoint_url=endpoint, create_bucket=True)
    await b.open()
    await b.close()


def _files(d: str) -> list[str]:
    return sorted(p for p in glob.glob(f"{d}/**/*", recursive=True)
                  if os.path.isfile(p) and os.path.getsize(p) >= 1 << 20)


def _raw_files(paths: list[str], piece: int, qd: int, direct: bool, bufs: list[np.ndarray]) -> int:
    """Read every file whole, ``qd`` reads of ``piece`` bytes in flight."""
    jobs = []
    fds = [os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in paths]
    for fd, p in zip(fds, paths):
        size = os.path.getsize(p) // 4096 * 4096
        jobs += [(fd, off, min(piece, size - off)) for off in range(0, size, piece)]

    def one(i: int) -> int:
        fd, off, n = jobs[i]
        return os.preadv(fd, [bufs[i % len(bufs)][:n]], off)

    try:
        with ThreadPoolExecutor(qd) as ex:
            return sum(ex.map(one, range(len(jobs))))
    finally:
        for fd in fds:
            os.close(fd)


def _drop_cache(paths: list[str]) -> None:
    """Drop ``paths`` from the page cache (POSIX_FADV_DONTNEED), so the next read comes from the device."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _measure(name: str, load: Callable[[], object], raw: Callable[[], int], repeats: int, nbytes: int,
             cold: Callable[[], None] | None = None, requests: Callable[[], int] | None = None) -> dict:
    """``cold`` (if given) runs, untimed, before every load and raw read; ``requests`` (if
    given) counts the requests the tier has sent so far, read before and after each measured load."""
    loads, raws, stages = [], [], []
    sent = 0
    for r in range(repeats + 1):  # round 0 warms up
        order = (("raw", raw), ("load", load)) if r % 2 else (("load", load), ("raw", raw))
        for what, fn in order:
            if cold is not None:
                cold()
            c0 = requests() if requests is not None and what == "load" else 0
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            if not r:
                continue
            if requests is not None and what == "load":
                sent += requests() - c0
            if what == "raw":
                raws.append(dt)
            else:
                loads.append(dt)
                stages.append(out)
        if r:
            _progress(f"{name} round {r}/{repeats}: load {loads[-1] * 1e3:.1f} ms raw {raws[-1] * 1e3:.1f} ms")
    ratios = [a / b for a, b in zip(loads, raws)]
    best = min(range(len(loads)), key=lambda i: loads[i])
    st = stages[best].stages  # type: ignore[attr-defined]
    return {"tier": name, "mib": nbytes / (1 << 20), "load_ms": min(loads) * 1e3, "raw_ms": min(raws) * 1e3,
            "load_gbps": nbytes / min(loads) / 1e9, "raw_gbps": nbytes / min(raws) / 1e9,
            "ratio_best": min(loads) / min(raws), "ratio_median": statistics.median(ratios),
            "read_ms": {k: v * 1e3 for k, v in st.read_s.items()}, "wait_ms": st.wait_s * 1e3,
            "decode_ms": st.decode_s * 1e3, "chunks": st.chunks, "restore_ms_median": statistics.median(loads) * 1e3,
            "requests_per_gb": osd_delay.per_gb(sent, nbytes * len(loads)) if requests is not None else None}


def _bench_tier(tier: str, args: argparse.Namespace, root: str, ceph: osd_delay.LocalCeph | None = None) -> dict:
    """One tier's row; ``ceph`` (s3 only): the cluster whose OSDs are delayed while it is measured."""
    n = args.blocks
    layout, ns, keys = _layout(args.shape, n)
    ids = list(range(1, n + 1))
    nbytes = n * record_bytes(layout.shape)
    cfg: dict = {"metrics_port": None, "host_capacity_bytes": 0}
    d = os.path.join(args.dir or root, f"restore-{tier}-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    server = None
    if tier == "host":
        cfg["host_capacity_bytes"] = nbytes * 2 + (64 << 20)
    elif tier == "ssd":
        cfg.update(ssd_dir=d, ssd_capacity_bytes=4 * nbytes + (1 << 30), ssd_io=args.ssd_io)
    else:  # object tiers: written through a scratch SSD tier, persisted, then read with the SSD tier off
        cfg.update(ssd_dir=os.path.join(d, "ssd"), ssd_capacity_bytes=4 * nbytes + (1 << 30))
        if tier == "objdir":
            cfg["object_url"] = f"file://{d}/objects"
        else:
            endpoint = args.s3_endpoint
            if not endpoint:  # a moto server in its own process (not sharing this one's GIL)
                from .s3 import _start_moto

                server, endpoint = _start_moto()
                os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
                os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
            asyncio.run(_make_bucket(endpoint))
            cfg.update(object_url=f"s3://{BUCKET}/restore-{os.getpid()}", s3_endpoint_url=endpoint,
                       s3_read_concurrency=args.s3_concurrency)
    _progress(f"{tier}: writing {n} blocks ({nbytes / (1 << 20):.0f} MiB)")
    store = build_store(TieredKVConfig.from_mapping(cfg), ns)
    try:
        assert store.submit_offload(layout, ids, keys, parents_of(keys)), "offload dropped"
        store.drain(120)
        if tier in ("objdir", "s3"):
            store.persist(120)
            store.close()
            cfg.pop("ssd_dir")
            store = build_store(TieredKVConfig.from_mapping(cfg), ns)
            _wait_index(store)
        found = store.lookup(keys).num_blocks
        assert found == n, f"{tier}: only {found} of {n} blocks are restorable"
        raw = _raw_for(tier, store, d, nbytes, args)

        def load() -> object:
            res = store.load(layout, ids, keys, timeout=120)
            assert not res.failed_block_ids, "load failed"
            return res

        cold = requests = None
        if tier == "objdir":  # buffered reads: both sides start from a cold page cache
            paths = _files(os.path.join(d, "objects"))
            cold = lambda: _drop_cache(paths)  # noqa: E731
        if tier in ("objdir", "s3"):
            stats = store.tiers[-1].backend.stats
            requests = lambda: osd_delay.object_requests({}, osd_delay.stats_snapshot(stats))  # noqa: E731
        with osd_delay.measured(ceph if tier == "s3" else None, args.osd_op_delay_ms) as delay:
            row = _measure(tier, load, raw, args.repeats, nbytes, cold, requests)
        return {**row, "osd_op_delay": delay}
    finally:
        store.close()
        if server is not None:
            server.terminate()
            server.wait(10)
        shutil.rmtree(d, ignore_errors=True)


def _wait_index(store, timeout: float = 120.0) -> None:
    """The object tier indexes in the background after open (misses until then): wait for it."""
    obj = store.tiers[-1]
    if hasattr(obj, "wait_ready"):
        asyncio.run_coroutine_threadsafe(obj.wait_ready(timeout), store._loop).result(timeout + 5)


def _raw_for(tier: str, store, d: str, nbytes: int, args: argparse.Namespace) -> Callable[[], int]:
    piece = args.piece_mib << 20
    if tier == "host":
        src, dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
        return lambda: int(np.copyto(dst, src) or nbytes)
    if tier in ("ssd", "objdir"):
        paths = _files(d if tier == "ssd" else os.path.join(d, "objects"))
        bufs = [aligned_buffer(piece) for _ in range(args.qd)]
        return lambda: _raw_files(paths, piece, args.qd, tier == "ssd", bufs)
    obj = store.tiers[-1]
    backend = obj.backend
    datas = sorted({obj.location(k)[0] for k in obj.keys()})  # noqa: SIM118 - a Tier, not a dict
    sizes = {}

    async def head() -> None:
        for name in datas:
            sizes[name] = (await backend.head(name)).size

    asyncio.run_coroutine_threadsafe(head(), store._loop).result(60)
    jobs = [(nm, off, min(piece, sizes[nm] - off)) for nm in datas for off in range(0, sizes[nm], piece)]
    bufs = [bytearray(piece) for _ in range(args.s3_concurrency)]

    async def gets() -> int:
        sem = asyncio.Semaphore(args.s3_concurrency)

        async def one(i: int) -> int:
            nm, off, n = jobs[i]
            async with sem:
                return await backend.get_range(nm, off, [memoryview(bufs[i % len(bufs)])[:n]]) or 0

        return sum(await asyncio.gather(*(one(i) for i in range(len(jobs)))))

    return lambda: asyncio.run_coroutine_threadsafe(gets(), store._loop).result(120)


def run(args: argparse.Namespace) -> dict:
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if args.osd_op_delay_ms is not None and "s3" not in tiers:
        raise SystemExit("bench restore_store: --osd-op-delay-ms delays the s3 tier's Ceph: add s3 to --tiers")
    ceph = osd_delay.hdd_mode("restore_store", args.s3_endpoint, args.osd_op_delay_ms, args.ceph_dir)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtkv-restore-") as root:
        for tier in tiers:
            rows.append(_bench_tier(tier, args, root, ceph))
    return {"shape": args.shape, "blocks": args.blocks, "tiers": {r["tier"]: r for r in rows}}


def format_result(res: dict) -> str:
    """One row per tier: the store's restore against the raw read of the same bytes, and its stages."""
    rows = [[r["tier"], r["mib"], r["load_ms"], r["load_gbps"], r["raw_ms"], r["raw_gbps"], r["ratio_best"],
             r["ratio_median"], sum(r["read_ms"].values()), r["wait_ms"], r["decode_ms"], r["chunks"]]
            for r in res["tiers"].values()]
    out = table(["tier", "MiB", "load ms", "GB/s", "raw ms", "raw GB/s", "load/raw best", "median", "read ms",
                 "wait ms", "decode ms", "chunks"], rows,
                fmts=["", ".0f", ".1f", ".2f", ".1f", ".2f", ".2f", ".2f", ".1f", ".1f", ".1f", ""],
                title=f"restore of {res['blocks']} blocks ({res['shape']}) through the store vs the raw read")
    lines = [osd_delay.summary_line(f"{r['tier']} (median)", r["requests_per_gb"], r["restore_ms_median"] / 1e3,
                                    r["mib"] * 2**20, r.get("osd_op_delay"))
             for r in res["tiers"].values() if r.get("requests_per_gb") is not None]
    return "\n".join([out, "", *lines]) if lines else out
