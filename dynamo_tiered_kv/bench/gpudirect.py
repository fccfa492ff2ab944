"""gpudirect: offload/onboard of engine blocks GPU-direct (device records + GDS) vs host bounce.

Both paths move the same engine blocks through one SSD tier in one run, ``--batch`` blocks per
request, rounds interleaved (``--repeats``, median reported):

* ``host_offload``: ``codec.encode_blocks`` into a (pinned) host slab, then ``write_many``;
* ``direct_offload``: ``device_codec.encode_blocks_on_device`` into a device slab, then
  ``write_many`` of device spans (NIXL GDS_MT);
* ``host_onboard`` / ``direct_onboard``: ``read_many`` into the slab, verify and scatter.

``encode``/``decode`` fields time the codecs alone (no I/O). On CUDA without GDS only those are
measured. ``--device cpu`` runs the CPU stand-in (host memory + NIXL POSIX), which checks the
harness, not GDS. GB/s is 10^9 record bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..blocks.codec import decode_blocks, encode_blocks, record_bytes
from ..blocks.device_codec import decode_blocks_on_device, encode_blocks_on_device
from ..blocks.keys import Namespace, chain_keys, parents_of
from ..blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from ..staging.device_slabs import DeviceSpan, DeviceStagingPool, synchronize
from ..staging.slabs import StagingPool
from ..tiers.base import ReadRequest
from ..tiers.ssd import SSDTier
from ..tiers.ssd.gds_probe import gds_verdict
from . import report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=None, help="directory on the NVMe device (default: a temp dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"],
                   help="cuda: GDS_MT; cpu: the CPU stand-in (host memory + NIXL POSIX, says nothing of GDS)")
    p.add_argument("--layers", type=int, default=32, help="layers (32 x 64 KiB: a Llama-3.1-8B 16-token block)")
    p.add_argument("--blocks", type=int, default=256, help="engine blocks moved per pass")
    p.add_argument("--batch", type=int, default=16, help="blocks per request (one prefix run)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are reported")


def run(args: argparse.Namespace) -> dict:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> dict:
    dev = torch.device(args.device)
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=args.layers, num_blocks=args.blocks + 1,
                            block_size=16, num_kv_heads=8, head_size=128, device=args.device)
    for t in ts:
        t.normal_()
    eng = EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 16, 8, 128)
    ns = Namespace("bench-gpudirect", "bfloat16", "KV_SPLIT", 16, args.layers, 8, 128)
    rb = record_bytes(eng.shape)
    batch = max(1, min(args.batch, args.blocks))
    batches = [list(range(i, min(i + batch, args.blocks))) for i in range(0, args.blocks, batch)]
    total = args.blocks * rb
    host_pool = StagingPool(batch * rb, 1, pin=dev.type == "cuda")
    dev_pool = DeviceStagingPool(batch * rb, 1, dev)
    verdict = gds_verdict()
    direct = dev.type == "cpu" or verdict.available
    dio = None
    if direct:
        from ..tiers.ssd.gds import DeviceIO

        dio = DeviceIO("POSIX" if dev.type == "cpu" else "GDS_MT")
        dio.register(dev_pool.slabs)
    root = Path(tempfile.mkdtemp(prefix="dtkv-bench-gd-", dir=args.dir))
    times: dict[str, list[float]] = {}
    hs, ds = host_pool.acquire(), dev_pool.acquire()

    def keys_for(tag: int) -> list[bytes]:
        return chain_keys(ns, np.arange(args.blocks * 16) + tag * 1_000_003)

    def timed(name: str, fn: Callable[[], None]) -> None:
        synchronize(dev)
        t0 = time.perf_counter()
        fn()
        synchronize(dev)
        times.setdefault(name, []).append(time.perf_counter() - t0)

    io = ("GDS_MT" if dev.type == "cuda" else "POSIX stand-in") if direct else f"none (no GDS: {verdict.reason})"
    report.progress("gpudirect", f"{args.device}: {args.blocks} blocks ({total / 2**20:.0f} MiB) per pass, "
                    f"{args.repeats} rounds; I/O {io}")
    steps = report.Steps("gpudirect", args.repeats)
    try:
        k = keys_for(0)
        par = parents_of(k)

        def enc_host() -> None:
            for b in batches:
                encode_blocks(eng, b, [ns.digest] * len(b), k[b[0]:b[-1] + 1], par[b[0]:b[-1] + 1], hs.array)

        def enc_dev() -> None:
            for b in batches:
                encode_blocks_on_device(eng, b, [ns.digest] * len(b), k[b[0]:b[-1] + 1], par[b[0]:b[-1] + 1],
                                        ds.tensor)

        last = batches[-1]  # what the slabs hold after encoding; decoded once per batch, into a spare block

        def dec_host() -> None:
            for _ in batches:
                errs = decode_blocks(hs.array[:len(last) * rb], eng, [args.blocks] * len(last),
                                     namespace=ns.digest, keys=k[last[0]:last[-1] + 1])
                assert errs == [None] * len(last), errs

        def dec_dev() -> None:
            for _ in batches:
                errs = decode_blocks_on_device(ds.tensor[:len(last) * rb], eng, [args.blocks] * len(last),
                                               namespace=ns.digest, keys=k[last[0]:last[-1] + 1])
                assert errs == [None] * len(last), errs

        for rnd in range(args.repeats):
            order = [("host_encode", enc_host), ("device_encode", enc_dev)]
            for name, fn in order if rnd % 2 == 0 else order[::-1]:
                timed(name, fn)
            # the slabs now hold the last batch's records: decode them (into a spare block)
            order = [("host_decode", dec_host), ("device_decode", dec_dev)]
            for name, fn in order if rnd % 2 == 0 else order[::-1]:
                timed(name, fn)
            if dio is not None:
                await _io_round(root / f"r{rnd}", eng, ns, batches, rb, hs, ds, dio, times, rnd, dev, keys_for)
            steps.step("round")
    finally:
        host_pool.release(hs)
        dev_pool.release(ds)
        if dio is not None:
            dio.close()
        host_pool.close()
        dev_pool.close()
        shutil.rmtree(root, ignore_errors=True)
    moved = {name: len(batches) * len(batches[-1]) * rb if name.endswith("_decode") else total for name in times}
    gbps = {name: moved[name] / float(np.median(v)) / 1e9 for name, v in times.items()}
    out: dict = {f"{name}_gbps": v for name, v in sorted(gbps.items())}
    for a, b in (("device_encode", "host_encode"), ("device_decode", "host_decode"),
                 ("direct_offload", "host_offload"), ("direct_onboard", "host_onboard")):
        if a in gbps:
            out[f"{a}_vs_host"] = gbps[a] / gbps[b]
    out.update({"device": str(dev), "gds": verdict.available, "gds_reason": verdict.reason,
                "io_backend": "GDS_MT" if dev.type == "cuda" and direct else ("POSIX stand-in" if direct else "none"),
                "bytes": total, "record_bytes": rb, "batch_blocks": batch, "repeats": args.repeats})
    return out


def format_result(res: dict) -> str:
    rows = []
    for what, dev_name, host_name in (("encode (build records)", "device_encode", "host_encode"),
                                      ("decode (verify + scatter)", "device_decode", "host_decode"),
                                      ("offload to SSD", "direct_offload", "host_offload"),
                                      ("onboard from SSD", "direct_onboard", "host_onboard")):
        if f"{dev_name}_gbps" in res:
            rows.append([what, res[f"{dev_name}_gbps"], res[f"{host_name}_gbps"], res.get(f"{dev_name}_vs_host")])
    title = (f"gpudirect: {res['device']}, I/O {res['io_backend']} (GDS {'usable' if res['gds'] else 'unusable'}: "
             f"{res['gds_reason']}), {res['bytes'] / 2**20:.0f} MiB per pass, {res['batch_blocks']} blocks per "
             f"request; median of {res['repeats']} rounds (GB/s = 10^9 bytes/s)")
    return report.table(["path", "device/direct GB/s", "host bounce GB/s", "ratio"], rows, title=title,
                        fmts=["", "", "", ".2f"])  # 3 significant digits: the CPU stand-in is slow


async def _io_round(path: Path, eng: EngineLayout, ns: Namespace, batches: list[list[int]], rb: int, hs, ds, dio,
                    times: dict[str, list[float]], rnd: int, dev: torch.device,
                    keys_for: Callable[[int], list[bytes]]) -> None:
    tier = SSDTier(path, capacity_bytes=len(batches) * len(batches[0]) * rb * 3 + (64 << 20), io="odirect",
                   idle_seal_s=None, device_io=dio)
    await tier.open()
    if tier.device_io is None:
        await tier.close()
        raise SystemExit(f"the SSD tier at {path} cannot use the GPU-direct path (O_DIRECT refused?)")
    try:
        hk, dk = keys_for(2 * rnd + 1), keys_for(2 * rnd + 2)
        hp, dp = parents_of(hk), parents_of(dk)

        async def host_offload() -> None:
            for b in batches:
                ks = hk[b[0]:b[-1] + 1]
                encode_blocks(eng, b, [ns.digest] * len(b), ks, hp[b[0]:b[-1] + 1], hs.array)
                await tier.write_many((key, memoryview(hs.array[j * rb:(j + 1) * rb])) for j, key in enumerate(ks))

        async def direct_offload() -> None:
            for b in batches:
                ks = dk[b[0]:b[-1] + 1]
                encode_blocks_on_device(eng, b, [ns.digest] * len(b), ks, dp[b[0]:b[-1] + 1], ds.tensor)
                await tier.write_many((key, DeviceSpan(ds, j * rb, rb)) for j, key in enumerate(ks))

        async def host_onboard() -> None:
            for b in batches:
                ks = hk[b[0]:b[-1] + 1]
                got = await tier.read_many([ReadRequest(key, memoryview(hs.array[j * rb:(j + 1) * rb]))
                                            for j, key in enumerate(ks)])
                assert None not in got
                assert decode_blocks(hs.array[:len(b) * rb], eng, b, namespace=ns.digest, keys=ks) == [None] * len(b)

        async def direct_onboard() -> None:
            for b in batches:
                ks = dk[b[0]:b[-1] + 1]
                got = await tier.read_many([ReadRequest(key, DeviceSpan(ds, j * rb, rb)) for j, key in enumerate(ks)])
                assert None not in got
                errs = decode_blocks_on_device(ds.tensor[:len(b) * rb], eng, b, namespace=ns.digest, keys=ks)
                assert errs == [None] * len(b), errs

        pairs = [[("host_offload", host_offload), ("direct_offload", direct_offload)],
                 [("host_onboard", host_onboard), ("direct_onboard", direct_onboard)]]
        for pair in pairs:
            for name, fn in pair if rnd % 2 == 0 else pair[::-1]:
                synchronize(dev)
                t0 = time.perf_counter()
                await fn()
                synchronize(dev)
                times.setdefault(name, []).append(time.perf_counter() - t0)
    finally:
        await tier.close()
        shutil.rmtree(path, ignore_errors=True)

