"""restore: marginal restore time of a long prefix per tier on the vLLM CPU engine vs the raw read of its bytes.

Model: random-weight Qwen2 (q/k/v bias), 8 layers, 2 KV heads of 128, bf16: 8 KiB of KV per
token (``QWEN2_BENCH_SPEC``, built offline). Prompts: ``--context`` tokens (8192: 8064 restored in
63 blocks of 128 tokens, 63 MiB of KV; the last block is always computed) and ``--short`` tokens.

**Marginal restore** = TTFT(long prompt restored) - TTFT(short prompt restored), medians over
``--rounds`` in the same process: what restoring the long prefix adds beyond the fixed per-request
cost (scheduling, sampling). It also holds the long prompt's computed tail attending over 8k tokens
of context, which no restore can avoid (on this CPU engine most of it). So each round also runs the
long prompt once more from vLLM's own prefix cache (the same tail over the same context, nothing
restored): **restore overhead** = TTFT(restored) - TTFT(prefix cache), what the restore itself cost
the request, and the restored first token must equal the prefix-cache one. Both are compared with
the raw read of the same records from the same place in the same process, between the requests:

* host tier (the process that stored the prompts): ``memcpy`` of the bytes the restore read;
* SSD (new process, host tier off, files dropped from the page cache): O_DIRECT ``preadv`` of the
  same segment-file ranges, ``--raw-depth`` requests of ``--raw-chunk-kib`` in flight;
* object tier (new process, host tier off, SSD wiped): the same for a local directory, or parallel
  ranged GETs of the same object ranges from the same server with ``--s3-endpoint`` /
  ``DTKV_S3_ENDPOINT`` (Ceph RGW or any S3).

Also measured on the same prompts: recompute (no connector) and vLLM's ``ExampleConnector`` cold
restore (its files fsynced and dropped from the page cache before every request). Reported: ours
/ raw, ExampleConnector / ours, TTFT reduction vs recompute, and the store's own restore stages
(``LoadResult.stages``: read per tier, wait, decode) when the store reports them.

``--sizes 256,2048,8192``: the same per prompt size, in the same sessions (so ratios of one size
compare with the same run's others): per tier and size the restore overhead / raw read, the wait
in the engine / raw read, ExampleConnector's overhead / ours, and how each restore ran (synchronous
in its step, or asynchronous and how many engine steps it was pending).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..engine.launch import (
    engine_base,
    kv_bytes_per_token,
    load_async_extra,
    model_desc,
    object_tier,
    require_vllm,
    run_plan,
)
from ..neighbours import busy_neighbours
from .report import format_tables, summarize

MODULE = "dynamo_tiered_kv.bench.restore.engine"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("dtkv-bench-restore"),
                   help="work directory: model, tiers, engine logs, restore.json")
    p.add_argument("--context", type=int, default=8192, help="long prompt tokens")
    p.add_argument("--short", type=int, default=256, help="short prompt tokens (the marginal's baseline)")
    p.add_argument("--sizes", default="",
                   help="size sweep, prompt tokens comma-separated (e.g. 256,2048,8192): each restored and "
                        "measured every round in the same sessions; the largest is the long prompt (--context)")
    p.add_argument("--block-size", type=int, default=128, help="engine and store block size in tokens")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per tier (medians are reported)")
    p.add_argument("--recompute-rounds", type=int, default=2, help="measured rounds without a connector")
    p.add_argument("--tiers", default="host,ssd,object", help="tiers to measure, comma-separated")
    p.add_argument("--raw-chunk-kib", type=int, default=2048, help="bytes per raw read request (KiB)")
    p.add_argument("--raw-depth", type=int, default=8, help="raw read requests in flight")
    p.add_argument("--s3-endpoint", default=os.environ.get("DTKV_S3_ENDPOINT"),
                   help="S3 server for the object tier (default $DTKV_S3_ENDPOINT, else a local directory)")
    p.add_argument("--s3-bucket", default="dtkv-bench-restore", help="bucket (created if missing)")
    p.add_argument("--load-async", choices=["default", "on", "off"], default="default",
                   help="connector load_async setting, where the store has it (default: its own default)")
    p.add_argument("--skip-example", action="store_true", help="no ExampleConnector sessions")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="N CPU-bound processes beside the engine for the whole run (a busy neighbour)")
    p.add_argument("--quick", action="store_true", help="1024-token prompt, 2 rounds (smoke run, ~2 min)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_vllm("restore")
    from ..engine.tiny_model import QWEN2_BENCH_SPEC, synthetic_tokens

    if args.quick:
        args.context, args.rounds, args.recompute_rounds = min(args.context, 1024), 2, 1
    sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    if sizes:
        args.context = max(sizes)
    work: Path = args.out
    work.mkdir(parents=True, exist_ok=True)
    for d in ("ssd", "example"):
        shutil.rmtree(work / d, ignore_errors=True)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    base = engine_base(work, args.context, args.block_size, QWEN2_BENCH_SPEC)
    v = QWEN2_BENCH_SPEC.vocab_size
    long, short = synthetic_tokens(args.context, seed=7001, vocab_size=v), synthetic_tokens(args.short, 7002, v)
    # their own tokens (seed per size): no prompt of the sweep is a prefix of another
    sweep = {str(n): synthetic_tokens(n, 7100 + n, v) for n in sizes if n != args.context}
    obj, obj_desc = object_tier(args, work)
    ssd = {"ssd_dir": str((work / "ssd").resolve()), "ssd_capacity_bytes": 8 << 30, "ssd_segment_bytes": 256 << 20}
    common = {"staging_slab_bytes": 16 << 20, "staging_slabs": 8, **load_async_extra(args.load_async)}
    dtkv = {"connector": "dtkv", "long": long, "short": short, "sweep": sweep, "rounds": args.rounds,
            "raw_chunk_bytes": args.raw_chunk_kib << 10, "raw_depth": args.raw_depth}
    s3_raw = {"raw": "s3", "s3_endpoint": args.s3_endpoint, "s3_bucket": args.s3_bucket} if args.s3_endpoint \
        else {"raw": "odirect", "evict": [str(work / "objects")]}
    ex = {"connector": "example", "shared_storage_path": str(work / "example"), "long": long, "short": short,
          "sweep": sweep}
    plan: list[tuple[str, dict[str, Any]]] = [
        ("host", {**dtkv, "store_first": True, "persist": True, "raw": "memcpy",
                  "extra_config": {"host_capacity_bytes": 1 << 30, **ssd, **obj, **common}})]
    if "ssd" in tiers:
        plan.append(("ssd", {**dtkv, "raw": "odirect", "raw_tier": "ssd", "evict": [ssd["ssd_dir"]],
                             "extra_config": {"host_capacity_bytes": 0, **ssd, **common}}))
    if "object" in tiers:
        plan.append(("object", {**dtkv, **s3_raw, "raw_tier": "object", "wipe_ssd": True,
                                "extra_config": {"host_capacity_bytes": 0, **obj, **common}}))
    plan.append(("recompute", {"connector": None, "long": long, "short": short, "rounds": args.recompute_rounds,
                               "warm": False}))
    if not args.skip_example:
        plan += [("example-store", {**ex, "store_first": True, "rounds": 0}),
                 ("example", {**ex, "rounds": args.rounds, "evict": [str(work / "example")]})]
    steps = [p[1]["rounds"] + p[1].get("warm", True) + bool(p[1].get("store_first")) for p in plan]
    print(f"dtkv bench restore: {model_desc(QWEN2_BENCH_SPEC)}; prompts {args.context} / {args.short} tokens, "
          f"block {args.block_size}; object tier: {obj_desc}; {len(plan)} engine sessions; output {work}",
          file=sys.stderr, flush=True)
    with busy_neighbours(args.busy):
        sessions = run_plan(plan, steps, base, work, "restore", MODULE, args.no_progress)
    res: dict[str, Any] = {"model": model_desc(QWEN2_BENCH_SPEC), "model_spec": QWEN2_BENCH_SPEC.__dict__,
                           "kv_bytes_per_token": kv_bytes_per_token(QWEN2_BENCH_SPEC), "context_tokens": args.context,
                           "short_tokens": args.short, "block_size": args.block_size, "rounds": args.rounds,
                           "object_tier": obj_desc, "raw_chunk_bytes": args.raw_chunk_kib << 10,
                           "raw_depth": args.raw_depth, "load_async": args.load_async, "cpu_count": os.cpu_count(),
                           "sizes": sizes, "busy": args.busy, "load_avg": os.getloadavg(), "sessions": sessions}
    res["summary"] = summarize(res)
    res["result_file"] = str(work / "restore.json")
    (work / "restore.json").write_text(json.dumps(res, indent=1))
    return res


def format_result(res: dict[str, Any]) -> str:
    return f"{format_tables(res)}\nfull result: {res['result_file']}"
