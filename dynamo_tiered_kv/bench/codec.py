"""codec: encode+checksum and decode+verify throughput against a plain memcpy of the same bytes.

All three run in one process on one core over the same working set (many distinct engine blocks,
so caches do not flatter any of them): ``memcpy`` copies each block's payload bytes from one
contiguous buffer into a staging slab; ``encode`` gathers the same blocks out of the engine's
paged layout into records (header + per-layer xxh3 checksums); ``decode`` verifies each record
and scatters it back into the engine layout, a staging slab of ``--batch`` records per call.
Each path is compared with a memcpy in its own
direction: ``memcpy_gbps`` engine bytes -> staging slab (encode's), ``memcpy_in_gbps`` record
payloads -> an engine-sized buffer (decode's). ``verify`` is a CUDA restore's host half (every
check, no scatter: ``codec.verify_for_device``), against the same ``memcpy_in``: on one core, and
with each load chunk (``--chunk-mib``) fanned out as the store's read pipeline does
(``store.reads.fanout``, ``verify_threads`` threads).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..blocks import codec
from ..blocks.keys import Namespace, chain_keys, parents_of
from ..blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from ..staging.slabs import StagingPool
from ..store.reads import fanout
from . import report


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


SHAPES = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 8, 128),  # 2 MiB per 16-token block
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", 24, 2, 64),  # 192 KiB per block
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all", help="model block shape to measure")
    p.add_argument("--layout", choices=[k.name.lower() for k in EngineLayoutKind], default="flash_attn",
                   help="engine KV layout gathered from / scattered into")
    p.add_argument("--working-set-mib", type=int, default=256, help="engine KV bytes cycled through")
    p.add_argument("--batch", type=int, default=8, help="blocks per encode call (one staging slab)")
    p.add_argument("--repeats", type=int, default=7, help="passes over the working set; best is kept")
    p.add_argument("--chunk-mib", type=int, default=8, help="load chunk the fanned-out verify splits")


def _best_gbps(fns: dict[str, Callable[[], int]], repeats: int,
               step: Callable[[str], None] = lambda _: None) -> dict[str, float]:
    """Best GB/s of each function; rounds interleave them so load changes hit all alike."""
    best = dict.fromkeys(fns, float("inf"))
    nbytes = dict.fromkeys(fns, 0)
    for fn in fns.values():
        fn()  # warm up: page faults, first touch
    step("warm-up")
    for r in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            nbytes[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t)
        step(f"pass {r + 1}/{repeats}")
    return {f"{name}_gbps": nbytes[name] / best[name] / 1e9 for name in fns}


def bench_shape(shape: ModelShape, kind: EngineLayoutKind, working_set: int, batch: int, repeats: int,
                steps: report.Steps | None = None, chunk_bytes: int = 8 << 20) -> dict:
    heads = 1 if kind is EngineLayoutKind.MLA else shape.kv_heads
    head = shape.kv_heads * shape.head_size if kind is EngineLayoutKind.MLA else shape.head_size
    per_block = 2 * shape.layers * shape.block_size * shape.kv_heads * shape.head_size * shape.dtype.itemsize
    nblocks = max(batch, working_set // per_block // batch * batch)
    ts = allocate_engine_kv(
        kind,
        num_layers=shape.layers,
        num_blocks=nblocks,
        block_size=shape.block_size,
        num_kv_heads=heads,
        head_size=head if kind is not EngineLayoutKind.MLA else 2 * head,
        dtype=shape.dtype,
    )
    for t in ts:
        t.view(torch.uint8).random_(0, 256)
    layout = EngineLayout(kind, ts, shape.block_size, heads, ts[0].shape[-1] if kind is EngineLayoutKind.MLA else head)
    ns = Namespace(
        shape.name, str(shape.dtype), kind.name, shape.block_size, shape.layers, heads, layout.shape.head_size
    )
    keys = chain_keys(ns, np.arange(nblocks * shape.block_size) % 50000)
    parents = parents_of(keys)
    rb = codec.record_bytes(layout.shape)
    hb = codec.header_bytes(layout.shape.num_layers)
    payload = layout.shape.payload_bytes
    pool = StagingPool(rb * batch, 1, pin=False)
    slab = pool.acquire().array
    flat = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in ts]) if len(ts) > 1 else None
    src_flat = flat if flat is not None else ts[0].reshape(-1).view(torch.uint8).numpy()
    records = np.zeros(rb * nblocks, np.uint8)
    nsd = [ns.digest] * batch

    def memcpy() -> int:
        for b in range(nblocks):
            j = b % batch
            np.copyto(slab[j * rb : j * rb + payload], src_flat[b * payload : (b + 1) * payload])
        return nblocks * payload

    def memcpy_in() -> int:  # the same bytes, records -> engine-sized buffer (decode's direction)
        for b in range(nblocks):
            np.copyto(src_flat[b * payload : (b + 1) * payload], records[b * rb + hb : b * rb + hb + payload])
        return nblocks * payload

    def encode() -> int:
        for b0 in range(0, nblocks, batch):
            ids = list(range(b0, b0 + batch))
            codec.encode_blocks(layout, ids, nsd, keys[b0 : b0 + batch], parents[b0 : b0 + batch], slab)
        return nblocks * payload

    for b0 in range(0, nblocks, batch):  # records to decode from, made once
        ids = list(range(b0, b0 + batch))
        codec.encode_blocks(layout, ids, nsd, keys[b0 : b0 + batch], parents[b0 : b0 + batch], records[b0 * rb :])

    def decode() -> int:
        for b0 in range(0, nblocks, batch):
            ids = list(range(b0, b0 + batch))
            errs = codec.decode_blocks(records[b0 * rb :], layout, ids, namespace=ns.digest, keys=keys[b0 : b0 + batch])
            if any(errs):
                raise RuntimeError(f"decode failed: {errs}")
        return nblocks * payload

    recs = [records[b * rb : (b + 1) * rb] for b in range(nblocks)]
    per_chunk = max(1, min(nblocks, chunk_bytes // rb))

    def verify_range(a: int, b: int) -> list:
        errs = codec.verify_for_device(recs[a:b], layout, namespace=ns.digest, keys=keys[a:b])
        if any(errs):
            raise RuntimeError(f"verify failed: {errs}")
        return errs

    def verify() -> int:
        for b0 in range(0, nblocks, per_chunk):
            verify_range(b0, min(nblocks, b0 + per_chunk))
        return nblocks * payload

    def verify_fanned() -> int:
        for b0 in range(0, nblocks, per_chunk):
            fanout.fan_out(min(per_chunk, nblocks - b0), rb, lambda a, b, b0=b0: verify_range(b0 + a, b0 + b))
        return nblocks * payload

    res: dict = {"block_bytes": payload, "record_bytes": rb, "blocks": nblocks, "verify_threads": fanout.WAYS,
                 "verify_compiled": codec.verify_is_compiled(layout), "chunk_records": per_chunk}
    fns = {"memcpy": memcpy, "encode": encode, "memcpy_in": memcpy_in, "decode": decode, "verify": verify,
           "verify_fanout": verify_fanned}
    res.update(_best_gbps(fns, repeats, lambda what: steps and steps.step(f"{shape.name}: {what}")))
    res["encode_ratio"] = res["encode_gbps"] / res["memcpy_gbps"]
    res["decode_ratio"] = res["decode_gbps"] / res["memcpy_in_gbps"]
    res["verify_ratio"] = res["verify_gbps"] / res["memcpy_in_gbps"]
    res["verify_fanout_ratio"] = res["verify_fanout_gbps"] / res["memcpy_in_gbps"]
    pool.close()
    return res


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    kind = EngineLayoutKind[args.layout.upper()]
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    report.progress("codec", f"{', '.join(names)}: {args.working_set_mib} MiB working set, {args.repeats} passes "
                    f"of memcpy / encode / memcpy_in / decode / verify / fanned-out verify each")
    steps = report.Steps("codec", len(names) * (args.repeats + 1))
    per = {n: bench_shape(SHAPES[n], kind, args.working_set_mib << 20, args.batch, args.repeats, steps,
                          args.chunk_mib << 20) for n in names}
    first = per[names[0]]
    out = {
        "shape": names[0],
        "layout": kind.name.lower(),
        "encode_gbps": first["encode_gbps"],
        "decode_gbps": first["decode_gbps"],
        "memcpy_gbps": first["memcpy_gbps"],
        "memcpy_in_gbps": first["memcpy_in_gbps"],
        "encode_ratio": first["encode_ratio"],
        "decode_ratio": first["decode_ratio"],
        "verify_gbps": first["verify_gbps"],
        "verify_fanout_gbps": first["verify_fanout_gbps"],
        "repeats": args.repeats,
        "shapes": per,
    }
    return out


def format_result(res: dict) -> str:
    """One table per shape: each path against the memcpy of the same bytes in its direction."""
    out = [f"codec: {res['layout']} layout, one core unless a row says threads, best of {res['repeats']} passes "
           f"(GB/s = 10^9 bytes/s)"]
    for name, r in res["shapes"].items():
        rows = [["encode (gather + checksum)", r["encode_gbps"], "memcpy engine -> slab", r["memcpy_gbps"],
                 r["encode_ratio"]],
                ["decode (verify + scatter)", r["decode_gbps"], "memcpy slab -> engine", r["memcpy_in_gbps"],
                 r["decode_ratio"]],
                [f"verify only{'' if r['verify_compiled'] else ' (Python)'}", r["verify_gbps"],
                 "memcpy slab -> engine", r["memcpy_in_gbps"], r["verify_ratio"]],
                [f"verify only, {r['verify_threads']} threads per chunk", r["verify_fanout_gbps"],
                 "memcpy slab -> engine", r["memcpy_in_gbps"], r["verify_fanout_ratio"]]]
        title = (f"\n{name}: {r['block_bytes'] / 2**10:.0f} KiB blocks, {r['record_bytes'] / 2**10:.0f} KiB records, "
                 f"{r['blocks']} blocks")
        out.append(report.table(["path", "GB/s", "ceiling", "GB/s", "ratio"], rows, title=title,
                                fmts=["", ".2f", "", ".2f", ".2f"]))
    return "\n".join(out)
