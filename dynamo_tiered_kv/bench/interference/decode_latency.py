"""interference: inter-token latency of decoding requests while other requests restore long prefixes.

vLLM CPU engine driven like a server (``LLMEngine.add_request`` at arrival times, ``step()`` in a
loop), same model as ``bench restore`` (random-weight Qwen2, 8 KiB of KV per token). ``--streams``
requests decode ``--decode-tokens`` each; once they all have their first token, ``--restores``
requests of ``--context`` tokens arrive ``--stagger-s`` apart and restore their prefix from one
tier (host in the process that stored them; SSD with the host tier off; object tier with the SSD
wiped) or, for comparison, are recomputed (no connector). Each round runs the streams alone
(baseline) and with the restores, order alternating. Reported per session: p50 / p99 / max
inter-token latency of the decoding streams with and without restores (target:
p99 with restores <= 1.2x without) and the restores' TTFT. With ``load_async`` in the connector's
settings, ``--load-async both`` measures synchronous and asynchronous onboarding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from ..engine.launch import engine_base, load_async_extra, model_desc, object_tier, require_vllm, run_plan
from ..report import percentile
from . import step_trace

MODULE = "dynamo_tiered_kv.bench.interference.engine"
TARGET = 1.2
#: thread groups the step-trace table shows (the engine's, then the connector's restore path)
TRACE_GROUPS = ["MainThread", "native", "dtkv-onboard", "dtkv-store", "asyncio"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("dtkv-bench-interference"),
                   help="work directory: model, tiers, engine logs, interference.json")
    p.add_argument("--context", type=int, default=8192, help="tokens of each restored (or recomputed) prompt")
    p.add_argument("--restores", type=int, default=2, help="long requests arriving during the decode")
    p.add_argument("--stagger-s", type=float, default=1.0, help="seconds between their arrivals")
    p.add_argument("--start-s", type=float, default=0.5, help="first arrival after every stream has a token")
    p.add_argument("--streams", type=int, default=4, help="decoding requests")
    p.add_argument("--decode-tokens", type=int, default=96, help="tokens each decoding request generates")
    p.add_argument("--decode-prompt-tokens", type=int, default=256, help="prompt tokens of a decoding request")
    p.add_argument("--rounds", type=int, default=2, help="baseline + restore rounds per session")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="engine token budget per step (chunked prefill of recomputed prompts)")
    p.add_argument("--long-prefill-tokens", type=int, default=0,
                   help="vLLM long_prefill_token_threshold: at most this many prompt tokens of one request per "
                        "step, so a restored request's suffix prefill is spread over steps (0: vLLM's default)")
    p.add_argument("--restore-cpu-share", type=float, default=None,
                   help="connector restore_cpu_share (pacing of verify+scatter against the forward; 0: unpaced; "
                        "default: the connector's)")
    p.add_argument("--block-size", type=int, default=128, help="engine and store block size in tokens")
    p.add_argument("--tiers", default="host,ssd,object,recompute", help="sessions to run, comma-separated")
    p.add_argument("--load-async", choices=["on", "off", "both", "default"], default="both",
                   help="connector load_async setting(s) to measure, where the store has the setting")
    p.add_argument("--s3-endpoint", default=os.environ.get("DTKV_S3_ENDPOINT"),
                   help="S3 server for the object tier (default $DTKV_S3_ENDPOINT, else a local directory)")
    p.add_argument("--s3-bucket", default="dtkv-bench-interference", help="bucket (created if missing)")
    p.add_argument("--no-resident", action="store_true",
                   help="skip the phase whose long requests find their prefixes in vLLM's own prefix cache")
    p.add_argument("--trace-steps", action="store_true",
                   help="time every engine step and each thread's CPU during it (a table per phase; "
                        "per-step records in interference.json)")
    p.add_argument("--quick", action="store_true", help="1024-token restores, 1 round, 32 tokens (smoke run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def summarize(sessions: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, s in sessions.items():
        base = [x for r in s["rounds"] for x in r["baseline"]["itl_ms"]]
        rest = [x for r in s["rounds"] for x in r["restore"]["itl_ms"]]
        ttft = [x for r in s["rounds"] for x in r["restore"]["restore_ttft_ms"] if x is not None]
        row = {"session": name, "samples": len(rest), "base_p50_ms": percentile(base, 0.5),
               "base_p99_ms": percentile(base, 0.99), "base_max_ms": max(base, default=float("nan")),
               "p50_ms": percentile(rest, 0.5), "p99_ms": percentile(rest, 0.99),
               "max_ms": max(rest, default=float("nan")),
               "restore_ttft_ms": statistics.median(ttft) if ttft else None}
        row["p99_ratio"] = row["p99_ms"] / row["base_p99_ms"]
        row["met"] = row["p99_ratio"] <= TARGET
        # the same long requests with their prefixes already in vLLM's prefix cache: the part of the
        # stall that is the engine's (their tails' prefill), not the restore's
        res = [x for r in s["rounds"] if "resident" in r for x in r["resident"]["itl_ms"]]
        row["resident_p99_ms"] = percentile(res, 0.99) if res else None
        row["p99_over_resident"] = row["p99_ms"] / row["resident_p99_ms"] if res else None
        if s.get("step_trace"):
            row["step_trace"] = step_trace.summarize(s["step_trace"])
        rows.append(row)
    return rows


def format_table(res: dict[str, Any]) -> str:
    lines = [f"engine: {res['model']}",
             f"{res['streams']} streams x {res['decode_tokens']} tokens decoding; {res['restores']} requests of "
             f"{res['context']} tokens arriving {res['stagger_s']} s apart; {res['rounds']} rounds; object tier: "
             f"{res['object_tier']}", "",
             "resident: the same long requests with their prefixes already in vLLM's prefix cache (no restore)",
             "",
             f"{'session':<16} {'ITL ms without restores':^23} | {'ITL ms with restores':^23} | {'p99':>6} "
             f"{'restore':>8} {'resident':>8} {'p99 /':>8}  target p99 <= {TARGET}x",
             f"{'':<16} {'p50':>7} {'p99':>7} {'max':>7} | {'p50':>7} {'p99':>7} {'max':>7} | {'ratio':>6} "
             f"{'TTFT ms':>8} {'p99 ms':>8} {'resident':>8}"]
    for r in res["rows"]:
        rp, ro = r.get("resident_p99_ms"), r.get("p99_over_resident")
        lines.append(f"{r['session']:<16} {r['base_p50_ms']:>7.1f} {r['base_p99_ms']:>7.1f} {r['base_max_ms']:>7.1f} | "
                     f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['max_ms']:>7.1f} | {r['p99_ratio']:>5.2f}x "
                     f"{r['restore_ttft_ms'] or float('nan'):>8.0f} {'-' if rp is None else f'{rp:.1f}':>8} "
                     f"{'-' if ro is None else f'{ro:.2f}x':>8}  {'met' if r['met'] else 'MISS'}")
    traced = [r for r in res["rows"] if r.get("step_trace")]
    if traced:
        lines += ["", "step trace (--trace-steps): engine steps, and CPU ms of each thread group during them "
                  "(summed over rounds; 'restoring': steps with a restore in flight, their p50)",
                  f"{'session':<16} {'phase':<9} {'steps':>5} {'wall ms':>8} {'p50':>6} {'p99':>6} {'restoring':>7} "
                  + " ".join(f"{g:>12}" for g in TRACE_GROUPS) + f" {'other':>8}"]
        for r in traced:
            lines += step_trace.format_rows(r["session"], r["step_trace"], TRACE_GROUPS)
    return "\n".join(lines)


def _plan(args: argparse.Namespace, work: Path, longs: list[list[int]], obj: dict[str, Any]) -> list[tuple[str, Any]]:
    wanted = [t.strip() for t in args.tiers.split(",") if t.strip()]
    modes = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}.get(args.load_async, ["default"])
    if not load_async_extra("on"):
        modes = ["default"]  # the store has no load_async setting (yet)
    ssd = {"ssd_dir": str((work / "ssd").resolve()), "ssd_capacity_bytes": 8 << 30, "ssd_segment_bytes": 256 << 20}
    common: dict[str, Any] = {"staging_slab_bytes": 16 << 20, "staging_slabs": 8}
    if args.restore_cpu_share is not None:
        common["restore_cpu_share"] = args.restore_cpu_share
    engine_args = {"max_num_seqs": args.streams + args.restores + 2, "max_num_batched_tokens": args.max_batched_tokens}
    if args.long_prefill_tokens:
        engine_args["long_prefill_token_threshold"] = args.long_prefill_tokens
    phase = {"restores": longs, "streams": args.streams, "decode_tokens": args.decode_tokens,
             "decode_prompt_tokens": args.decode_prompt_tokens, "start_s": args.start_s, "stagger_s": args.stagger_s,
             "rounds": args.rounds, "resident": not args.no_resident, "trace_steps": args.trace_steps,
             "engine_args": engine_args}
    plan: list[tuple[str, Any]] = []
    for tier in ("host", "ssd", "object"):
        for i, m in enumerate(modes):
            name = tier if m == "default" else f"{tier}-async-{m}"
            la = {**common, **load_async_extra(m)}
            if tier == "host" and (tier in wanted or not plan):
                seed = not plan  # the first host session also fills SSD + objects for the others
                tiers = {**ssd, **obj} if seed else {}
                plan.append((name, {**phase, "connector": "dtkv", "store": longs, "persist": seed,
                                    "extra_config": {"host_capacity_bytes": 1 << 30, **tiers, **la}}))
            elif tier == "ssd" and tier in wanted:
                plan.append((name, {**phase, "connector": "dtkv", "extra_config": {"host_capacity_bytes": 0,
                                                                                     **ssd, **la}}))
            elif tier == "object" and tier in wanted:
                plan.append((name, {**phase, "connector": "dtkv", "wipe_ssd": i == 0,
                                    "extra_config": {"host_capacity_bytes": 0, **obj, **la}}))
    if "recompute" in wanted:
        plan.append(("recompute", {**phase, "connector": None, "rounds": 1}))
    return plan


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_vllm("interference")
    from ..engine.tiny_model import QWEN2_BENCH_SPEC, synthetic_tokens

    # not at module level: the package would import the engine module before ``python -m`` runs it
    from .engine import MAX_DECODE_FACTOR

    if args.quick:
        args.context, args.rounds, args.decode_tokens = min(args.context, 1024), 1, 32
    work: Path = args.out
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "ssd", ignore_errors=True)
    base = engine_base(work, args.context, args.block_size, QWEN2_BENCH_SPEC)
    # room for every request at once: no restore waits for KV space the streams hold
    per_stream = args.decode_prompt_tokens + args.decode_tokens * MAX_DECODE_FACTOR
    base["gpu_blocks"] = (args.restores * base["max_model_len"] + args.streams * per_stream) // args.block_size + 16
    longs = [synthetic_tokens(args.context, seed=9100 + i, vocab_size=QWEN2_BENCH_SPEC.vocab_size)
             for i in range(args.restores)]
    obj, obj_desc = object_tier(args, work)
    plan = _plan(args, work, longs, obj)
    steps = [len(p[1].get("store", [])) + (2 + p[1]["resident"]) * p[1]["rounds"] for p in plan]
    print(f"dtkv bench interference: {model_desc(QWEN2_BENCH_SPEC)}; sessions {', '.join(p[0] for p in plan)}; "
          f"object tier: {obj_desc}; output {work}", file=sys.stderr, flush=True)
    sessions = run_plan(plan, steps, base, work, "interference", MODULE, args.no_progress)
    res: dict[str, Any] = {"model": model_desc(QWEN2_BENCH_SPEC), "context": args.context, "restores": args.restores,
                           "stagger_s": args.stagger_s, "streams": args.streams, "decode_tokens": args.decode_tokens,
                           "rounds": args.rounds, "max_batched_tokens": args.max_batched_tokens,
                           "object_tier": obj_desc, "load_async": args.load_async,
                           "long_prefill_tokens": args.long_prefill_tokens,
                           "restore_cpu_share": args.restore_cpu_share, "cpu_count": os.cpu_count(),
                           "sessions": sessions}
    res["rows"] = summarize(sessions)
    res["result_file"] = str(work / "interference.json")
    (work / "interference.json").write_text(json.dumps(res, indent=1))
    return res


def format_result(res: dict[str, Any]) -> str:
    return f"{format_table(res)}\nfull result: {res['result_file']}"
