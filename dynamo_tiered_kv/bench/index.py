"""Object index at scale: RAM per block, open from a snapshot / full listing, incremental refresh.

Manifests are synthesized directly (no data objects: nothing is read) under one namespace, plus
a few under a second namespace whose requests are counted (must be 0). Local directory by
default; ``--endpoint`` runs against S3 (Ceph RGW).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from ..tiers.objectstore.backend import ObjectBackend, ObjectInfo, Source
from ..tiers.objectstore.layout import manifest_name, ns_prefix

NS_A, NS_B = b"\xaa" * 16, b"\xbb" * 16
BLOCK = 2 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed (default 1M; try 10M)")
    p.add_argument("--blocks-per-manifest", type=int, default=128, help="records per data object (256 MiB of 2 MiB)")
    p.add_argument("--new-manifests", type=int, default=100, help="manifests added before the refresh")
    p.add_argument("--endpoint", help="S3 endpoint (e.g. http://127.0.0.1:7480); default: a local directory")
    p.add_argument("--bucket", default="dtkv-bench-index", help="bucket on --endpoint (created if missing)")
    p.add_argument("--dir", help="local directory (default: a temporary one, removed after)")


def _manifest(rng: bytes, n: int, created: float) -> tuple[str, bytes]:
    body = {"created_at": created, "data": f"data/{xxhash.xxh3_128_hexdigest(rng)}.seg", "data_size": n * BLOCK,
            "entries": [[os.urandom(16).hex(), i * BLOCK, BLOCK] for i in range(n)], "origin": "bench",
            "version": 1}
    raw = json.dumps(body, separators=(",", ":"), sort_keys=True)
    doc = json.dumps({"body": body, "xxh3": xxhash.xxh3_64_hexdigest(raw.encode())}, separators=(",", ":"),
                     sort_keys=True)
    return manifest_name(created, xxhash.xxh3_128_hexdigest(rng + b"m")), doc.encode()


class _Counting(ObjectBackend):
    """Passes every call through; counts requests whose name is under ``watch``."""

    def __init__(self, base: ObjectBackend, watch: str) -> None:
        super().__init__()
        self.base, self.watch, self.url, self.stats = base, watch, base.url, base.stats
        self.foreign = 0

    def _see(self, name: str) -> None:
        self.foreign += name.startswith(self.watch)

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


async def _synth(backend: ObjectBackend, root: Path | None, ns: bytes, blocks: int, per: int, t0: float,
                 label: str) -> int:
    """Write ``blocks`` worth of manifests under ``ns`` (one a second); returns how many."""
    n_man = (blocks + per - 1) // per
    sem = asyncio.Semaphore(32)
    done = 0

    async def put(i: int) -> None:
        nonlocal done
        name, raw = _manifest(i.to_bytes(8, "little") + ns, min(per, blocks - i * per), t0 + i * 1.0)
        if root is not None:
            p = root / ns_prefix(ns) / name
            p.write_bytes(raw)
        else:
            async with sem:
                await backend.put_object(ns_prefix(ns) + name, raw)
        done += 1
        if done % 20000 == 0:
            print(f"  {label}: {done}/{n_man} manifests written", file=sys.stderr, flush=True)

    if root is not None:
        (root / ns_prefix(ns) / "manifests").mkdir(parents=True, exist_ok=True)
    for s in range(0, n_man, 2048):
        await asyncio.gather(*(put(i) for i in range(s, min(n_man, s + 2048))))
    return n_man


async def _go(args: argparse.Namespace, root: Path | None) -> dict[str, Any]:
    from ..tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend

    def backend() -> ObjectBackend:
        if root is not None:
            return LocalDirBackend(root)
        return S3Backend(args.bucket, endpoint_url=args.endpoint, access_key=os.environ.get("DTKV_S3_ACCESS_KEY"),
                         secret_key=os.environ.get("DTKV_S3_SECRET_KEY"), create_bucket=True)

    be = backend()
    await be.open()
    t0 = time.time() - 2 * 86400  # manifests spaced 1 s apart, within the 14-day TTL
    print(f"synthesizing {args.blocks} blocks ...", file=sys.stderr, flush=True)
    n_man = await _synth(be, root, NS_A, args.blocks, args.blocks_per_manifest, t0, "namespace A")
    await _synth(be, root, NS_B, 10 * args.blocks_per_manifest, args.blocks_per_manifest, t0, "namespace B")
    await be.close()
    out: dict[str, Any] = {"target": be.url, "blocks": args.blocks, "manifests": n_man,
                           "blocks_per_manifest": args.blocks_per_manifest}

    async def open_tier() -> tuple[ObjectTier, _Counting, float]:
        cb = _Counting(backend(), ns_prefix(NS_B))
        tier = ObjectTier(cb, namespace=NS_A, snapshot_every=0, read_legacy=False, max_concurrency=32)
        t = time.perf_counter()
        await tier.open()
        returned = time.perf_counter() - t
        await tier.wait_ready()
        out.setdefault("open_returned_s", returned)
        return tier, cb, time.perf_counter() - t

    rss0 = _rss()
    print("open from a full listing ...", file=sys.stderr, flush=True)
    tier, cb, dt = await open_tier()
    assert len(tier._cat) == args.blocks, (len(tier._cat), args.blocks)
    tier._cat.index.compact()
    out["open_full_listing_s"] = dt
    out["open_full_listing_blocks_per_s"] = args.blocks / dt
    out["index_bytes_per_block"] = tier.index_bytes() / args.blocks
    out["rss_bytes_per_block"] = (_rss() - rss0) / args.blocks
    t = time.perf_counter()
    await tier.write_snapshot()
    out["snapshot_write_s"] = time.perf_counter() - t
    foreign = cb.foreign
    await tier.close()
    del tier
    print("open from the snapshot ...", file=sys.stderr, flush=True)
    tier, cb, dt = await open_tier()
    assert len(tier._cat) == args.blocks and tier.stats.snapshot_loads == 1
    out["open_snapshot_s"] = dt
    out["open_snapshot_blocks_per_s"] = args.blocks / dt
    be2 = backend()
    await be2.open()
    new_blocks = args.new_manifests * args.blocks_per_manifest
    await _synth(be2, root, NS_A, new_blocks, args.blocks_per_manifest, time.time(), "new")
    await be2.close()
    reqs = tier.backend.stats.gets + tier.backend.stats.lists
    t = time.perf_counter()
    await tier.refresh(full=False)
    out["refresh_new_manifests"] = args.new_manifests
    out["refresh_s"] = time.perf_counter() - t
    out["refresh_requests"] = tier.backend.stats.gets + tier.backend.stats.lists - reqs
    assert len(tier._cat) >= args.blocks + new_blocks - args.blocks_per_manifest
    out["requests_for_other_namespace"] = foreign + cb.foreign
    await tier.close()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.endpoint:
        return asyncio.run(_go(args, None))
    if args.dir:
        return asyncio.run(_go(args, Path(args.dir)))
    with tempfile.TemporaryDirectory(prefix="dtkv-bench-index-") as d:
        return asyncio.run(_go(args, Path(d)))
