"""sglang: SGLang HiCache page set/get through our backend against the raw tier, same run.

SGLang's own ``MHATokenToKVPoolHost`` (CPU memory) holds ``--pages`` host pages of a
Llama-3.1-8B-shaped model by default (32 layers, 8 KV heads of 128, 16-token pages, bf16:
2 MiB a page). Per tier (``--tiers``, each alone under the backend) and host layout
(``--layouts``), each round times, on fresh page hashes:

* ``set``: ``batch_set_v1`` of every page (SGLang's 128-page batches) until the tier holds them
  (gather from the host pool + checksums into staging, then the tier write);
* ``get``: ``batch_get_v1`` of the same pages into other host pages (tier read, verify, scatter);
* ``raw_write`` / ``raw_read``: the same number of already-encoded records written to and read
  from a second instance of the same tier with its own ``write_many`` / ``read_many`` (no
  backend, no gather, no verify): the ceiling the backend's own work is measured against.

Rounds interleave the paths (``--repeats``) and medians are reported; ``memcpy_gbps`` is one copy
of a round's bytes. GB/s is 10^9 bytes per second of page payload. Needs sglang 0.5.23
(``.ci/install-sglang.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import report
from ..restore.raw import memcpy

STORAGE_BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per batched storage call


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiers", default="host,ssd", help="comma list of host, ssd (each measured alone)")
    p.add_argument("--layouts", default="page_first,page_first_direct",
                   help="SGLang host layouts (layer_first, page_first, page_first_direct, page_head)")
    p.add_argument("--pages", type=int, default=64, help="pages per round")
    p.add_argument("--layers", type=int, default=32, help="model layers (default: Llama-3.1-8B's 32)")
    p.add_argument("--heads", type=int, default=8, help="KV heads per TP rank")
    p.add_argument("--head-dim", type=int, default=128, help="head size")
    p.add_argument("--page-size", type=int, default=16, help="tokens per SGLang page (--page-size)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--dir", type=Path, default=None, help="SSD directory (default: a temporary one)")


def run(args: argparse.Namespace) -> dict:
    from . import host as sh

    sgl = sh.load_sglang()
    work = Path(tempfile.mkdtemp(prefix="dtkv-bench-sglang-", dir=args.dir))
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    rows: list[dict[str, Any]] = []
    page_bytes = 0
    try:
        for tier in tiers:
            for layout in layouts:
                row = _measure(sgl, sh, args, tier, layout, work / f"{tier}-{layout}")
                page_bytes = row.pop("page_bytes")
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    nbytes = page_bytes * args.pages
    return {"sglang": sgl.version, "pages": args.pages, "page_bytes": page_bytes, "repeats": args.repeats,
            "memcpy_gbps": nbytes / memcpy(nbytes) / 1e9, "rows": rows}


def _tier_settings(tier: str, d: Path, cap: int) -> dict[str, Any]:
    if tier == "host":
        return {"host_capacity_bytes": cap}
    if tier == "ssd":
        return {"host_capacity_bytes": 0, "ssd_dir": str(d / "ssd"), "ssd_capacity_bytes": 4 * cap,
                "ssd_seal_idle_s": 60.0}
    raise SystemExit(f"dtkv bench sglang: unknown tier {tier!r} (host, ssd)")


def _raw_tier(tier: str, d: Path, cap: int) -> Any:
    if tier == "host":
        from ...tiers.host import HostTier

        return HostTier(cap)
    from ...tiers.ssd import SSDTier

    return SSDTier(d / "raw-ssd", capacity_bytes=4 * cap, segment_bytes=256 << 20, idle_seal_s=None)


def _measure(sgl: Any, sh: Any, args: argparse.Namespace, tier: str, layout: str, d: Path) -> dict[str, Any]:
    import torch

    from ...blocks.codec import encode_blocks, record_bytes
    from ...blocks.layout import EngineLayout
    from ...tiers.base import ReadRequest
    from ...tiers.ssd.io import aligned_buffer
    from .._keys import random_key

    n, ps = args.pages, args.page_size
    pool = sh.mha_host_pool(sgl, layout, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                            page_size=ps, pages=2 * n + 1)
    src, dst = pool.alloc(n * ps), pool.alloc(n * ps)
    pool.kv_buffer.view(torch.int16).random_(-2**15, 2**15)  # any bits: only bytes move

    eng = EngineLayout.from_sglang_host(pool.kv_buffer, layout, ps, mla=False)
    rb = record_bytes(eng.shape)
    cap = 3 * n * rb + (64 << 20)
    settings = {**_tier_settings(tier, d, cap), "staging_slab_bytes": max(32 << 20, rb), "staging_slabs": 8,
                "max_pending_offloads": 256}
    backend = sh.attach(sgl, sh.storage_config(sgl, sh.backend_extra(**settings), model_name="bench"), pool)
    records = aligned_buffer(n * rb)
    pages = [int(i) // ps for i in src[::ps].tolist()]
    loop = asyncio.new_event_loop()
    raw = _raw_tier(tier, d, cap)
    loop.run_until_complete(raw.open())
    into = aligned_buffer(n * rb)
    times: dict[str, list[float]] = {"set": [], "get": [], "raw_write": [], "raw_read": []}
    report.progress("sglang", f"{tier} / {layout}: {n} pages of {eng.shape.payload_bytes} bytes")
    try:
        for r in range(args.repeats):
            hashes = sh.page_hashes(sgl, list(range(r * n * ps, (r + 1) * n * ps)), ps, prior=f"{r:064x}")
            t0 = time.perf_counter()
            ok = []
            for i in range(0, n, STORAGE_BATCH):
                ok += backend.batch_set_v1(hashes[i:i + STORAGE_BATCH], src[i * ps:(i + STORAGE_BATCH) * ps])
            backend.store.drain(120)
            times["set"].append(time.perf_counter() - t0)
            if not all(ok) or backend.batch_exists(hashes) != n:
                raise SystemExit(f"dtkv bench sglang: {tier}/{layout}: pages were dropped; raise staging")
            t0 = time.perf_counter()
            got = []
            for i in range(0, n, STORAGE_BATCH):
                got += backend.batch_get_v1(hashes[i:i + STORAGE_BATCH], dst[i * ps:(i + STORAGE_BATCH) * ps])
            times["get"].append(time.perf_counter() - t0)
            if not all(got):
                raise SystemExit(f"dtkv bench sglang: {tier}/{layout}: a page failed to restore")
            keys = [random_key(10_000 * (r + 1) + j) for j in range(n)]
            encode_blocks(eng, pages, [backend.namespace.digest] * n, keys, keys, records)
            views = [memoryview(records[j * rb:(j + 1) * rb]) for j in range(n)]
            t0 = time.perf_counter()
            loop.run_until_complete(raw.write_many(list(zip(keys, views))))
            times["raw_write"].append(time.perf_counter() - t0)
            reqs = [ReadRequest(k, memoryview(into[j * rb:(j + 1) * rb])) for j, k in enumerate(keys)]
            t0 = time.perf_counter()
            res = loop.run_until_complete(raw.read_many(reqs))
            times["raw_read"].append(time.perf_counter() - t0)
            if any(x is None for x in res):
                raise SystemExit(f"dtkv bench sglang: raw {tier} tier lost records")
    finally:
        backend.close()
        loop.run_until_complete(raw.close())
        loop.close()
    nbytes = n * eng.shape.payload_bytes
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"tier": tier, "layout": layout, "compiled_path": eng.fast_table() is not None,
            "set_gbps": gbps["set"], "raw_write_gbps": gbps["raw_write"], "set_vs_raw": gbps["set"] / gbps["raw_write"],
            "get_gbps": gbps["get"], "raw_read_gbps": gbps["raw_read"], "get_vs_raw": gbps["get"] / gbps["raw_read"],
            "rounds_s": times, "page_bytes": eng.shape.payload_bytes}


def format_result(res: dict) -> str:
    rows = [[r["tier"], r["layout"], r["compiled_path"], r["set_gbps"], r["raw_write_gbps"], r["set_vs_raw"],
             r["get_gbps"], r["raw_read_gbps"], r["get_vs_raw"]] for r in res["rows"]]
    title = (f"dtkv bench sglang (sglang {res['sglang']}): {res['pages']} pages of {res['page_bytes']} bytes, "
             f"median of {res['repeats']} rounds; memcpy {res['memcpy_gbps']:.2f} GB/s")
    return report.table(["tier", "host layout", "compiled", "set GB/s", "raw write", "ratio", "get GB/s",
                         "raw read", "ratio"], rows, title=title,
                        fmts=["", "", "", ".2f", ".2f", ".2f", ".2f", ".2f", ".2f"])
