"""Object index at scale: RAM per block, open from a snapshot / full listing, refresh, store start.

Manifests are synthesized directly (no data objects: nothing is read) under namespace A, plus a
few under namespace B; every request is counted per namespace (a tier of A must send none for
B). Synthesis runs in a child process, so the RSS measured here holds only the index build.

Target: ``--object-url file:///dir`` or ``s3://bucket/prefix`` (default: a temporary directory),
with the settings every ``dtkv`` command takes (``--s3-endpoint-url``, ``DYN_TIERED_KV_S3_*``,
``--config``). Each run writes under its own ``run-<id>/`` prefix and deletes it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from ..blocks.keys import BlockKey, Namespace
from ..config import settings_cli
from ..tiers.objectstore.backend import ObjectBackend, ObjectInfo, Source
from ..tiers.objectstore.index import release_free_heap
from ..tiers.objectstore.layout import manifest_name, ns_prefix
from ..tiers.objectstore.tenants import ERASURE_DIR

NS_A = Namespace("dtkv-bench-index-a", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)
NS_B = Namespace("dtkv-bench-index-b", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)
BLOCK = 2 << 20
STARTS = 3  # store starts per bucket (empty, full), alternating


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed (default 1M; try 10M)")
    p.add_argument("--blocks-per-manifest", type=int, default=128, help="records per data object (256 MiB of 2 MiB)")
    p.add_argument("--new-manifests", type=int, default=100, help="manifests added before the refresh")
    p.add_argument("--object-url", help="s3://bucket/prefix or file:///dir (default: a temporary directory); "
                   "the run writes under <url>/run-<id>/ and removes it after")
    p.add_argument("--create-bucket", action="store_true", help="create the S3 bucket if it is missing")
    p.add_argument("--keep", action="store_true", help="leave the synthesized objects in place")
    settings_cli.add_arguments(p)


def _manifest(rng: bytes, n: int, created: float) -> tuple[str, bytes]:
    body = {"created_at": created, "data": f"data/{xxhash.xxh3_128_hexdigest(rng)}.seg", "data_size": n * BLOCK,
            "entries": [[os.urandom(16).hex(), i * BLOCK, BLOCK] for i in range(n)], "origin": "bench",
            "version": 1}
    raw = json.dumps(body, separators=(",", ":"), sort_keys=True)
    doc = json.dumps({"body": body, "xxh3": xxhash.xxh3_64_hexdigest(raw.encode())}, separators=(",", ":"),
                     sort_keys=True)
    return manifest_name(created, xxhash.xxh3_128_hexdigest(rng + b"m")), doc.encode()


class _Counting(ObjectBackend):
    """Passes every call through; counts requests per namespace prefix (``ns/<hex>``, or root)."""

    def __init__(self, base: ObjectBackend) -> None:
        super().__init__()
        self.base, self.url, self.stats = base, base.url, base.stats
        self.by_ns: Counter[str] = Counter()

    def _see(self, name: str) -> None:
        parts = name.split("/")
        if name.startswith(ERASURE_DIR):  # the bucket's tenant erasure markers: every node reads them
            self.by_ns["erasures"] += 1
            return
        self.by_ns["/".join(parts[:2]) if parts[0] == "ns" and len(parts) > 1 else "root"] += 1

    async def open(self) -> None:
        await self.base.open()

    async def close(self) -> None:
        await self.base.close()

    async def put_object(self, name: str, source: Source, *, if_absent: bool = False) -> bool:
        self._see(name)
        return await self.base.put_object(name, source, if_absent=if_absent)

    async def get_range(self, name: str, offset: int, dests: Sequence[memoryview]) -> int | None:
        self._see(name)
        return await self.base.get_range(name, offset, dests)

    async def head(self, name: str) -> ObjectInfo | None:
        self._see(name)
        return await self.base.head(name)

    async def list(self, prefix: str = "", *, start_after: str = "") -> list[ObjectInfo]:
        self._see(prefix)
        return await self.base.list(prefix, start_after=start_after)

    async def delete(self, name: str) -> bool:
        self._see(name)
        return await self.base.delete(name)

    async def get_bytes(self, name: str) -> bytes | None:
        self._see(name)
        return await self.base.get_bytes(name)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _backend(url: str, s3: dict[str, Any]) -> ObjectBackend:
    from ..tiers.objectstore import backend_from_url

    return backend_from_url(url, **s3) if url.startswith("s3://") else backend_from_url(url)


async def _synth(url: str, s3: dict[str, Any], ns: bytes, blocks: int, per: int, t0: float, label: str) -> int:
    """Write ``blocks`` worth of manifests under ``ns`` (one a second); returns how many."""
    n_man = (blocks + per - 1) // per
    root = Path(url.removeprefix("file://")) if url.startswith("file://") else None
    be = _backend(url, s3)
    await be.open()
    sem = asyncio.Semaphore(32)
    done = 0

    async def put(i: int) -> None:
        nonlocal done
        name, raw = _manifest(i.to_bytes(8, "little") + ns, min(per, blocks - i * per), t0 + i * 1.0)
        if root is not None:  # a plain file write: the tier's temp+fsync+rename is not what is measured
            (root / ns_prefix(ns) / name).write_bytes(raw)
        else:
            async with sem:
                await be.put_object(ns_prefix(ns) + name, raw)
        done += 1
        if done % 20000 == 0:
            print(f"  {label}: {done}/{n_man} manifests written", file=sys.stderr, flush=True)

    if root is not None:
        (root / ns_prefix(ns) / "manifests").mkdir(parents=True, exist_ok=True)
    for s in range(0, n_man, 2048):
        await asyncio.gather(*(put(i) for i in range(s, min(n_man, s + 2048))))
    await be.close()
    return n_man


def _synth_proc(*args: Any) -> None:
    asyncio.run(_synth(*args))


def _in_child(*args: Any) -> None:
    """``_synth`` in a fresh process: its garbage never reaches this process's RSS."""
    p = multiprocessing.get_context("spawn").Process(target=_synth_proc, args=args)
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"synthesizing manifests failed (exit code {p.exitcode})")


async def _remove_all(url: str, s3: dict[str, Any]) -> None:
    be = _backend(url, s3)
    await be.open()
    sem = asyncio.Semaphore(32)

    async def rm(name: str) -> None:
        async with sem:
            await be.delete(name)

    names = [o.name for o in await be.list("")]
    await asyncio.gather(*(rm(n) for n in names))
    await be.close()


async def _tier_runs(args: argparse.Namespace, url: str, s3: dict[str, Any], out: dict[str, Any]) -> None:
    from ..tiers.objectstore import ObjectTier

    counted: list[_Counting] = []

    async def open_tier() -> tuple[ObjectTier, float]:
        cb = _Counting(_backend(url, s3))
        counted.append(cb)
        tier = ObjectTier(cb, namespace=NS_A.digest, snapshot_every=0, read_legacy=False, max_concurrency=32)
        t = time.perf_counter()
        await tier.open()
        returned = time.perf_counter() - t
        await tier.wait_ready()
        out.setdefault("open_returned_s", returned)
        return tier, time.perf_counter() - t

    gc.collect()
    release_free_heap()  # a clean baseline: what is freed before now is not the index's
    rss0 = _rss()
    print("open from a full listing ...", file=sys.stderr, flush=True)
    tier, dt = await open_tier()
    assert len(tier._cat) == args.blocks, (len(tier._cat), args.blocks)
    out["open_full_listing_s"] = dt
    out["open_full_listing_blocks_per_s"] = args.blocks / dt
    out["index_bytes_per_block"] = tier.index_bytes() / args.blocks
    out["rss_bytes_per_block"] = (_rss() - rss0) / args.blocks
    out["peak_rss_bytes_per_block"] = (_peak_rss() - rss0) / args.blocks
    t = time.perf_counter()
    await tier.write_snapshot()
    out["snapshot_write_s"] = time.perf_counter() - t
    await tier.close()
    del tier
    print("open from the snapshot ...", file=sys.stderr, flush=True)
    tier, dt = await open_tier()
    assert len(tier._cat) == args.blocks and tier.stats.snapshot_loads == 1
    out["open_snapshot_s"] = dt
    # RSS of a node that started from the snapshot: the first tier's memory is freed and handed
    # back, as a process that never built it would not hold it
    gc.collect()
    release_free_heap()
    out["rss_bytes_per_block_from_snapshot"] = (_rss() - rss0) / args.blocks
    out["open_snapshot_blocks_per_s"] = args.blocks / dt
    new_blocks = args.new_manifests * args.blocks_per_manifest
    await asyncio.to_thread(_in_child, url, s3, NS_A.digest, new_blocks, args.blocks_per_manifest, time.time(),
                            "new")
    reqs = tier.backend.stats.gets + tier.backend.stats.lists
    t = time.perf_counter()
    await tier.refresh(full=False)
    out["refresh_new_manifests"] = args.new_manifests
    out["refresh_s"] = time.perf_counter() - t
    out["refresh_requests"] = tier.backend.stats.gets + tier.backend.stats.lists - reqs
    assert len(tier._cat) >= args.blocks + new_blocks - args.blocks_per_manifest
    await tier.close()
    total: Counter[str] = Counter({ns_prefix(NS_A.digest).rstrip("/"): 0, ns_prefix(NS_B.digest).rstrip("/"): 0})
    for cb in counted:
        total.update(cb.by_ns)
    out["requests_by_namespace"] = {("A" if k == ns_prefix(NS_A.digest).rstrip("/") else
                                     "B" if k == ns_prefix(NS_B.digest).rstrip("/") else k): v
                                    for k, v in sorted(total.items())}
    out["requests_for_other_namespace"] = sum(v for k, v in total.items()
                                              if k not in (ns_prefix(NS_A.digest).rstrip("/"), "erasures"))


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _store_start(settings: settings_cli.Settings, url: str) -> tuple[float, float]:
    """(build_store + its first lookup returned, index ready) of an object-only store, in s."""
    from ..factory import build_store

    cfg = settings.config.model_copy(update={
        "object_url": url, "host_capacity_bytes": 0, "ssd_dir": None, "metrics_port": None,
        "staging_slab_bytes": 1 << 20, "staging_slabs": 1, "object_refresh_s": None})
    t = time.perf_counter()
    store = build_store(cfg, NS_A)
    store.lookup([BlockKey(b"\0" * 16)])  # answered from memory: a miss while the index loads
    started = time.perf_counter() - t
    obj = store.tiers[-1]
    while not obj.index_ready:  # type: ignore[attr-defined]
        time.sleep(0.005)
    ready = time.perf_counter() - t
    store.close()
    return started, ready


def _store_starts(settings: settings_cli.Settings, url: str, empty_url: str, out: dict[str, Any]) -> None:
    runs: dict[str, list[tuple[float, float]]] = {"empty": [], "full": []}
    for _ in range(STARTS):
        runs["empty"].append(_store_start(settings, empty_url))
        runs["full"].append(_store_start(settings, url))
    for k, rs in runs.items():
        out[f"store_start_{k}_s"] = statistics.median(r[0] for r in rs)
        out[f"store_index_ready_{k}_s"] = statistics.median(r[1] for r in rs)
    out["store_start_extra_s"] = out["store_start_full_s"] - out["store_start_empty_s"]


def _run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    settings = settings_cli.load(args)
    s3 = settings.s3_kwargs()
    if base.startswith("s3://") and args.create_bucket:
        s3["create_bucket"] = True
    run_id = uuid.uuid4().hex[:12]
    url = f"{base.rstrip('/')}/run-{run_id}"
    empty_url = f"{url}/empty-bucket"  # its own prefix: nothing under it
    if url.startswith("file://"):
        Path(empty_url.removeprefix("file://")).mkdir(parents=True)
    out: dict[str, Any] = {"target": url, "blocks": args.blocks, "blocks_per_manifest": args.blocks_per_manifest}
    t0 = time.time() - 2 * 86400  # manifests spaced 1 s apart, within the 14-day TTL
    try:
        print(f"synthesizing {args.blocks} blocks ...", file=sys.stderr, flush=True)
        data_url = f"{url}/bucket"
        _in_child(data_url, s3, NS_A.digest, args.blocks, args.blocks_per_manifest, t0, "namespace A")
        _in_child(data_url, s3, NS_B.digest, 10 * args.blocks_per_manifest, args.blocks_per_manifest, t0,
                  "namespace B")
        out["manifests"] = (args.blocks + args.blocks_per_manifest - 1) // args.blocks_per_manifest
        asyncio.run(_tier_runs(args, data_url, s3, out))
        print("store starts (empty bucket, full bucket) ...", file=sys.stderr, flush=True)
        _store_starts(settings, data_url, empty_url, out)
    finally:
        if not args.keep and url.startswith("s3://"):
            asyncio.run(_remove_all(url, s3))
        elif not args.keep:
            shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.object_url:
        if not args.object_url.startswith(("s3://", "file://")):
            raise SystemExit("dtkv bench index: --object-url must be s3://bucket/prefix or file:///dir")
        return _run(args, args.object_url)
    with tempfile.TemporaryDirectory(prefix="dtkv-bench-index-") as d:
        return _run(args, f"file://{d}")
