"""store: TieredStore offload and load through the host tier, against memcpy of the same bytes.

``offload``: ``submit_offload`` of a batch of engine blocks (gather + checksum into a staging
slab on the caller's thread) until the background loop has written them to the host tier
(``drain``): two copies per byte. Its ceiling, ``memcpy2``, copies the same bytes engine ->
slab -> host arena with ``np.copyto``. ``offload_call`` is the engine-visible part alone (what
``wait_for_save`` costs the engine thread).
``load``: ``lookup`` + ``load`` of the same blocks from the host tier into other engine blocks
(host -> slab -> verify -> engine); ceiling ``memcpy2`` in the other direction.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..blocks.codec import record_bytes
from ..blocks.keys import Namespace, chain_keys, parents_of
from ..blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from ..staging.slabs import StagingPool
from ..store import TieredStore
from ..tiers.host import HostTier
from . import report
from .codec import SHAPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b", help="model block shape")
    p.add_argument("--layout", choices=["flash_attn", "vllm_cpu"], default="flash_attn", help="engine KV layout")
    p.add_argument("--blocks", type=int, default=256, help="blocks per request (one offload / one load)")
    p.add_argument("--repeats", type=int, default=5, help="rounds; the best is kept")


def run(args: argparse.Namespace) -> dict:
    shape = SHAPES[args.shape]
    kind = EngineLayoutKind[args.layout.upper()]
    n = args.blocks
    tensors = allocate_engine_kv(kind, num_layers=shape.layers, num_blocks=2 * n + 1, block_size=shape.block_size,
                                 num_kv_heads=shape.kv_heads, head_size=shape.head_size, dtype=shape.dtype)
    for t in tensors:
        t.normal_()
    layout = EngineLayout(kind, tensors, shape.block_size, shape.kv_heads, shape.head_size)
    rb = record_bytes(layout.shape)
    payload = layout.shape.payload_bytes
    staging = StagingPool(max(rb * 64, 4 << 20), 8, pin=False)
    src_ids, dst_ids = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    ceiling_src = np.empty(n * payload, np.uint8)
    ceiling_mid = np.empty_like(ceiling_src)
    ceiling_dst = np.empty_like(ceiling_src)
    ceiling_src[::4096] = 1
    ceiling_mid[::4096] = 1
    ceiling_dst[::4096] = 1
    best = {"offload": float("inf"), "offload_call": float("inf"), "load": float("inf"), "memcpy2": float("inf")}
    report.progress("store", f"{shape.name}: {n} blocks ({n * payload / 2**20:.0f} MiB) per request, "
                    f"1 warm-up + {args.repeats} rounds")
    steps = report.Steps("store", args.repeats + 1)
    for r in range(args.repeats + 1):  # round 0 warms up (page faults, first touch)
        ns = Namespace(shape.name, str(shape.dtype), kind.name, shape.block_size, shape.layers, shape.kv_heads,
                       shape.head_size, tenant_salt=f"bench-{r}")
        keys = chain_keys(ns, np.arange(n * shape.block_size) % 50000)
        host = HostTier(2 * n * rb + (64 << 20), chunk_bytes=rb, pin=False)
        with TieredStore([host], ns, staging, max_pending_offloads=1 << 16) as store:
            t0 = time.perf_counter()
            assert store.submit_offload(layout, src_ids, keys, parents_of(keys)), "offload dropped: raise slabs"
            t1 = time.perf_counter()
            store.drain()
            t2 = time.perf_counter()
            assert store.lookup(keys).num_blocks == n
            res = store.load(layout, dst_ids, keys, timeout=60)
            t3 = time.perf_counter()
            assert not res.failed_block_ids
        t4 = time.perf_counter()
        np.copyto(ceiling_mid, ceiling_src)
        np.copyto(ceiling_dst, ceiling_mid)
        t5 = time.perf_counter()
        steps.step("warm-up" if r == 0 else f"round {r}: offload {(t2 - t0) * 1000:.1f} ms, "
                   f"load {(t3 - t2) * 1000:.1f} ms")
        if r:
            for name, dt in (("offload", t2 - t0), ("offload_call", t1 - t0), ("load", t3 - t2),
                             ("memcpy2", t5 - t4)):
                best[name] = min(best[name], dt)
    staging.close()
    gb = n * payload / 1e9
    out = {"shape": shape.name, "layout": kind.name, "blocks": n, "block_bytes": payload,
           "request_mib": n * payload / (1 << 20)}
    for name, dt in best.items():
        out[f"{name}_gbps"] = gb / dt
        out[f"{name}_ms"] = dt * 1000
    out["offload_vs_memcpy2"] = out["offload_gbps"] / out["memcpy2_gbps"]
    out["load_vs_memcpy2"] = out["load_gbps"] / out["memcpy2_gbps"]
    return out


def format_result(res: dict) -> str:
    rows = [["offload (until drained)", res["offload_ms"], res["offload_gbps"], res["offload_vs_memcpy2"]],
            ["offload call (engine thread)", res["offload_call_ms"], res["offload_call_gbps"],
             res["offload_call_gbps"] / res["memcpy2_gbps"]],
            ["load (lookup + load)", res["load_ms"], res["load_gbps"], res["load_vs_memcpy2"]],
            ["memcpy x2 (ceiling)", res["memcpy2_ms"], res["memcpy2_gbps"], 1.0]]
    title = (f"store: {res['shape']} ({res['layout']}), {res['blocks']} blocks = {res['request_mib']:.0f} MiB "
             f"per request, host tier; best round (GB/s = 10^9 bytes/s)")
    return report.table(["path", "ms", "GB/s", "vs memcpy x2"], rows, title=title, fmts=["", ".1f", ".2f", ".2f"])
