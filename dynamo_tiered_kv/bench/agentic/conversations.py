"""agentic: multi-turn agents on the vLLM CPU engine: TTFT recompute vs restore from host, SSD, objects.

``--agents`` conversations run round-robin, ``--idle-s`` apart (the agent runs a tool; the engine
serves the others). Every turn appends ``--tool-tokens`` of tool output to the agent's history and
generates ``--answer-tokens``; contexts grow every turn. Agent ``i`` starts with
``system_tokens * (i + 1) / agents`` tokens of system prompt and repository context, so contexts
span a range up to ``system_tokens + turns * (tool + answer)``. The engine's own KV space
(``num_gpu_blocks_override``) holds one context and a little more, so the conversations cannot all
stay resident: every turn's history must come back from the store or be recomputed.

Four engine sessions (fresh processes, same model, same prompts):

1. ``live`` (host + SSD + object tier): the conversations; then each turn's full prompt is measured
   again with the engine's prefix cache emptied first: **host** tier restores.
2. ``recompute`` (no connector): each prompt's full prefill: the baseline.
3. ``ssd`` (new process, no host tier): the SSD tier restores.
4. ``object`` (new process, no host tier, no SSD: a node that only shares the object tier): the
   object tier restores (S3 with ``--s3-endpoint`` / ``DTKV_S3_ENDPOINT``, else a local directory).

TTFT is the wall time of ``generate(max_tokens=1)``. ``restore GB/s`` is bytes read from the tier
divided by the time inside the connector's load hooks. Tables on stdout, the full result in
``--out``/agentic.json, PNG plots next to it.
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
    BENCH_SPEC,
    BLOCK_SIZE,
    EngineSessions,
    kv_bytes_per_token,
    model_desc,
    object_tier,
    require_vllm,
)
from ..report import key_values
from . import report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("dtkv-bench-agentic"),
                   help="directory for agentic.json, the plots and the engine logs")
    p.add_argument("--agents", type=int, default=3, help="concurrent agent conversations")
    p.add_argument("--turns", type=int, default=4, help="turns per agent")
    p.add_argument("--system-tokens", type=int, default=6144, help="largest agent's starting context")
    p.add_argument("--tool-tokens", type=int, default=1024, help="tool output tokens added per turn")
    p.add_argument("--answer-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--idle-s", type=float, default=1.0, help="idle gap between turns")
    p.add_argument("--gpu-blocks", type=int, default=0,
                   help="engine KV blocks of 64 tokens (default: one maximal context + 8)")
    p.add_argument("--host-mib", type=int, default=2048, help="host tier capacity in the live session")
    p.add_argument("--s3-endpoint", default=os.environ.get("DTKV_S3_ENDPOINT"),
                   help="S3 server for the object tier (default $DTKV_S3_ENDPOINT, else a local directory)")
    p.add_argument("--s3-bucket", default="dtkv-bench-agentic", help="bucket on --s3-endpoint (created if missing)")
    p.add_argument("--quick", action="store_true", help="2 agents x 3 turns of small contexts (~2 min)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG charts (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def _conversations(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ..engine.tiny_model import synthetic_tokens

    v = BENCH_SPEC.vocab_size
    return [{"system": synthetic_tokens(args.system_tokens * (a + 1) // args.agents, seed=1000 + a, vocab_size=v),
             "tools": [synthetic_tokens(args.tool_tokens, seed=2000 + 100 * a + t, vocab_size=v)
                       for t in range(args.turns)]}
            for a in range(args.agents)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_vllm("agentic")
    if args.quick:
        args.agents, args.turns, args.system_tokens, args.tool_tokens = 2, 3, 2048, 512
    from ..engine.tiny_model import build_tiny_model

    work: Path = args.out
    work.mkdir(parents=True, exist_ok=True)
    for d in ("ssd", "objects", "example"):
        shutil.rmtree(work / d, ignore_errors=True)
    build_tiny_model(work / "model", BENCH_SPEC)
    max_ctx = args.system_tokens + args.turns * (args.tool_tokens + args.answer_tokens + 1)
    max_len = min(BENCH_SPEC.max_position_embeddings, -(-(max_ctx + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE)
    gpu_blocks = args.gpu_blocks or max_len // BLOCK_SIZE + 8
    obj, obj_desc = object_tier(args, work)
    if not args.s3_endpoint:
        obj_desc += " (no --s3-endpoint / DTKV_S3_ENDPOINT given)"
    ssd = {"ssd_dir": str((work / "ssd").resolve()), "ssd_capacity_bytes": 8 << 30, "ssd_segment_bytes": 64 << 20}
    common = {"staging_slab_bytes": 16 << 20, "staging_slabs": 4, **obj}
    base = {"model": str(work / "model"), "max_model_len": max_len, "block_size": BLOCK_SIZE,
            "gpu_blocks": gpu_blocks}
    convs = _conversations(args)
    n_turns = args.agents * args.turns
    print(f"dtkv bench agentic: {model_desc()}; {args.agents} agents x {args.turns} turns, contexts up to "
          f"{max_ctx} tokens; engine KV space {gpu_blocks} blocks x {BLOCK_SIZE} = {gpu_blocks * BLOCK_SIZE} "
          f"tokens; object tier: {obj_desc}; output {work}", file=sys.stderr, flush=True)
    sessions: dict[str, Any] = {}
    with EngineSessions(work, n_turns * 5, "agentic", "req", args.no_progress) as runner:
        # the live session's steps: each turn, then its replay
        sessions["live"] = runner.run({**base, "mode": "live", "connector": "dtkv", "conversations": convs,
                                       "answer_tokens": args.answer_tokens, "idle_s": args.idle_s,
                                       "extra_config": {"host_capacity_bytes": args.host_mib << 20, **ssd,
                                                        **common}}, 2 * n_turns, name="live", label="live (host tier)")
        prompts = sessions["live"]["live"]["prompts"]
        plan = [("recompute", None, {}), ("ssd", "dtkv", {"host_capacity_bytes": 0, **ssd, **common}),
                ("object", "dtkv", {"host_capacity_bytes": 0, **common})]
        for name, conn, extra in plan:
            sessions[name] = runner.run({**base, "mode": "replay", "connector": conn, "prompts": prompts,
                                         "extra_config": extra}, n_turns, name=name)
    for s in sessions.values():  # the prompts are in the spec files; keep the result readable
        s.get("live", {}).pop("prompts", None)
    result = {"model": model_desc(), "model_spec": BENCH_SPEC.__dict__, "kv_bytes_per_token": kv_bytes_per_token(),
              "agents": args.agents, "turns": args.turns, "system_tokens": args.system_tokens,
              "tool_tokens": args.tool_tokens, "answer_tokens": args.answer_tokens, "idle_s": args.idle_s,
              "gpu_blocks": gpu_blocks, "block_size": BLOCK_SIZE, "max_model_len": max_len,
              "object_tier": obj_desc, "cpu_count": os.cpu_count(), "sessions": sessions}
    result["summary"] = report.summarize(result)
    result["output"] = str(work / "agentic.json")
    (work / "agentic.json").write_text(json.dumps(result, indent=1))
    (work / "agentic.md").write_text(report.markdown(result) + "\n")
    if not args.no_plots:
        result["plots"] = [str(p) for p in report.plot(result, work)]
    return result


def format_result(result: dict[str, Any]) -> str:
    """The tables, then the few headline numbers, one per line."""
    head = report.headline(result)
    return (f"{report.format_tables(result)}\n\n{key_values(head)}\n"
            f"full results: {result['output']} (and agentic.md beside it)")
