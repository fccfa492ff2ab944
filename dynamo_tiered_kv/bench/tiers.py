"""tiers: every data path against its raw ceiling, and the connector against vLLM's ExampleConnector.

One run, one machine. Raw ceilings (each from its own benchmark module, same process):

* codec: encode (gather + checksum) / decode (verify + scatter) vs ``memcpy`` (``bench codec``);
* host: ``TieredStore`` offload / load through the host tier vs two memcpys (``bench store``);
* SSD: tier write / read vs raw O_DIRECT ``pwritev``/``preadv`` in the same directory (``bench ssd``);
* S3: object-tier multipart PUT / ranged GET vs raw aiobotocore, same server (``bench s3``; Ceph
  RGW or any server with ``--s3-endpoint`` / ``DTKV_S3_ENDPOINT``, else a moto server).

Engine comparison (vLLM CPU engine, ``BENCH_SPEC`` model, in-process engine, one fresh process per
session, the same independent prompts of ``--contexts`` tokens for every connector):

* **store time** for a prompt: how long until its KV is durable, counted beyond the prefill itself.
  ExampleConnector: engine-thread time inside ``save_kv_layer`` + ``wait_for_save`` (it writes
  safetensors files synchronously there). dtkv: the same hooks' time (gather + checksum into
  staging) plus, after the request returns, the time until ``store.drain`` reports every accepted
  offload written and acknowledged by the host and SSD tiers (O_DIRECT + fdatasync).
* **restore time**: time to first token (``generate(max_tokens=1)``) of the prompt plus one token in
  a fresh engine process that finds the prefix stored (dtkv: host tier off, served by the SSD tier
  with O_DIRECT; ExampleConnector "cold": its files fsynced and dropped from the page cache with
  ``POSIX_FADV_DONTNEED`` first, "warm": read again from the page cache), and the load itself:
  ExampleConnector's time inside its load hooks (``start_load_kv`` + ``wait_for_layer_load``),
  dtkv's ``TieredStore.load`` time (asynchronous restores run on onboarding threads; its hooks
  only submit them).
* recompute: the same prompt's TTFT with no connector.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .engine.launch import BENCH_SPEC, BLOCK_SIZE, EngineSessions, engine_base, kv_bytes_per_token, model_desc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("dtkv-bench-tiers"), help="work directory (engine logs, KV)")
    p.add_argument("--dir", type=Path, default=None, help="SSD directory to measure (default: OUT/ssd-raw)")
    p.add_argument("--s3-endpoint", default=os.environ.get("DTKV_S3_ENDPOINT"),
                   help="S3 server (default $DTKV_S3_ENDPOINT, else a moto server)")
    p.add_argument("--contexts", default="2048,8192", help="engine prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="prompts per length (independent contents)")
    p.add_argument("--quick", action="store_true", help="small sizes everywhere (CI smoke run)")
    p.add_argument("--skip-raw", action="store_true", help="only the engine comparison")
    p.add_argument("--skip-engine", action="store_true", help="only the raw data paths")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def _sub(module: Any, argv: list[str]) -> dict[str, Any]:
    """Run another benchmark module's ``run`` with its own parser's defaults plus ``argv``."""
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    ns = p.parse_args(argv)
    ns.json = True
    return module.run(ns)


def raw_paths(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The four data paths against their ceilings; ``paths`` rows: (ours, ceiling, ratio) in GB/s."""
    from . import codec, s3, ssd, store

    q = args.quick
    d = args.dir or work / "ssd-raw"
    d.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    res["codec"] = _sub(codec, ["--shape", "qwen2.5-0.5b", "--layout", "vllm_cpu",
                                *(["--working-set-mib", "32", "--repeats", "2"] if q else [])])
    res["store"] = _sub(store, ["--layout", "vllm_cpu", *(["--blocks", "64", "--repeats", "2"] if q else [])])
    res["ssd"] = _sub(ssd, ["--dir", str(d), *(["--size", "64MiB", "--repeats", "2"] if q else ["--size", "512MiB"])])
    s3_argv = ["--bucket", "dtkv-bench-tiers"]
    if args.s3_endpoint:
        s3_argv += ["--endpoint", args.s3_endpoint]
    res["s3"] = _sub(s3, [*s3_argv, *(["--segment-mib", "16", "--repeats", "1"] if q else [])])
    shutil.rmtree(d, ignore_errors=True)
    c, st, sd, o = res["codec"], res["store"], res["ssd"], res["s3"]
    res["paths"] = {
        "codec encode vs memcpy": (c["encode_gbps"], c["memcpy_gbps"]),
        "codec decode vs memcpy": (c["decode_gbps"], c["memcpy_in_gbps"]),
        "host offload vs 2x memcpy": (st["offload_gbps"], st["memcpy2_gbps"]),
        "host load vs 2x memcpy": (st["load_gbps"], st["memcpy2_gbps"]),
        "SSD write vs raw O_DIRECT": (sd["write_gbps"], sd["raw_write_gbps"]),
        "SSD read vs raw O_DIRECT": (sd["read_gbps"], sd["raw_read_gbps"]),
        f"S3 PUT vs raw aiobotocore ({o.get('server', args.s3_endpoint)})": (o["put_gbps"], o["raw_put_gbps"]),
        f"S3 GET vs raw aiobotocore ({o.get('server', args.s3_endpoint)})": (o["get_gbps"], o["raw_get_gbps"]),
    }
    res["paths"] = {k: {"gbps": a, "ceiling_gbps": b, "ratio": a / b} for k, (a, b) in res["paths"].items()}
    return res


def engine_compare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """ExampleConnector vs dtkv on the same engine and prompts: store and restore (see module doc)."""
    from .engine.tiny_model import synthetic_tokens

    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        contexts, args.repeats = [min(contexts[0], 1024)], 1
    base = engine_base(work, max(contexts), BLOCK_SIZE, BENCH_SPEC, mode="replay")
    # ExampleConnector stores the first n tokens of an (n+1)-token prompt and only finds them again for
    # a prompt of n+2 tokens (it assumes "cached prompt + one new token"): store with p, restore with
    # p + [t]; every connector and the recompute baseline see exactly these prompts.
    stored = [{"agent": i, "turn": n, "prompt": synthetic_tokens(n + 2, seed=5000 + 17 * i + n,
                                                                  vocab_size=BENCH_SPEC.vocab_size)}
              for i in range(args.repeats) for n in contexts]  # interleaved lengths
    restored = [dict(p) for p in stored]
    for p in stored:
        p["prompt"] = p["prompt"][:-1]
    prompts = stored
    for d in ("example", "ssd"):
        shutil.rmtree(work / d, ignore_errors=True)
    ours = {"ssd_dir": str((work / "ssd").resolve()), "ssd_capacity_bytes": 8 << 30, "ssd_segment_bytes": 64 << 20,
            "staging_slab_bytes": 16 << 20, "staging_slabs": 4}
    ex = {"connector": "example", "shared_storage_path": str(work / "example")}
    plan = [("recompute", {"connector": None, "prompts": restored}),
            ("example-store", {**ex, "prompts": stored}), ("example-restore", {**ex, "prompts": restored}),
            ("example-restore-warm", {**ex, "prompts": restored}),
            ("dtkv-store", {"connector": "dtkv", "prompts": stored,
                            "extra_config": {"host_capacity_bytes": 1 << 30, **ours}}),
            ("dtkv-restore", {"connector": "dtkv", "prompts": restored,
                              "extra_config": {"host_capacity_bytes": 0, **ours}})]
    sess: dict[str, Any] = {}
    with EngineSessions(work, len(plan) * len(prompts), "tiers engine", "req", args.no_progress) as runner:
        for name, extra in plan:
            if name == "example-restore":
                _evict_page_cache(work / "example")  # cold: as after a restart, or on another node
            sess[name] = runner.run({**base, **extra}, len(prompts), name=f"tiers-{name}", label=name)["replay"]
    return {"model": model_desc(), "rows": compare_rows(sess, contexts), "sessions": sess}


def compare_rows(sess: dict[str, list[dict[str, Any]]], contexts: list[int]) -> list[dict[str, Any]]:
    """Per context length: medians over the repeats (``*_min_ms``: the best request) of each session."""
    rows = []
    for n in contexts:
        def med(session: str, key: str, n: int = n) -> float:
            return statistics.median(r.get(key, 0.0) for r in sess[session] if r["turn"] == n)

        kv_mb = (n // BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token() / 1e6
        row: dict[str, Any] = {"context_tokens": n, "kv_mb": kv_mb, "recompute_ms": med("recompute", "ttft_ms")}
        for c in ("example", "dtkv"):
            row[f"{c}_store_ms"] = med(f"{c}-store", "save_hook_ms") + med(f"{c}-store", "drain_ms")
            row[f"{c}_store_request_ms"] = med(f"{c}-store", "ttft_ms")
            row[f"{c}_restore_ttft_ms"] = med(f"{c}-restore", "ttft_ms")
            # ExampleConnector loads inside its hooks; dtkv restores on its onboarding threads
            row[f"{c}_restore_load_ms"] = med(f"{c}-restore", "restore_ms" if c == "dtkv" else "load_hook_ms")
            row[f"{c}_restore_lookup_ms"] = med(f"{c}-restore", "lookup_ms")
            row[f"{c}_restored_tokens"] = med(f"{c}-restore", "cached_tokens")
        for c in ("example", "dtkv"):
            row[f"{c}_restore_ttft_min_ms"] = min(r["ttft_ms"] for r in sess[f"{c}-restore"] if r["turn"] == n)
        row["example_restore_warm_ttft_ms"] = med("example-restore-warm", "ttft_ms")
        row["example_restore_warm_load_ms"] = med("example-restore-warm", "load_hook_ms")
        row["dtkv_save_hook_ms"] = med("dtkv-store", "save_hook_ms")
        row["dtkv_drain_ms"] = med("dtkv-store", "drain_ms")
        row["store_speedup"] = row["example_store_ms"] / row["dtkv_store_ms"]
        # what each connector costs the engine thread (dtkv's SSD write continues in the background)
        row["store_engine_speedup"] = row["example_store_ms"] / row["dtkv_save_hook_ms"]
        row["restore_ttft_speedup"] = row["example_restore_ttft_ms"] / row["dtkv_restore_ttft_ms"]
        row["restore_load_speedup"] = row["example_restore_load_ms"] / max(row["dtkv_restore_load_ms"], 1e-6)
        row["same_output"] = {c: all(a["first_token"] == b["first_token"] for a, b in
                                     zip(sess["recompute"], sess[f"{c}-restore"], strict=True) if a["turn"] == n)
                              for c in ("example", "dtkv")}
        rows.append(row)
    return rows


def _evict_page_cache(root: Path) -> None:
    """Make ``root``'s files durable and drop them from the page cache (POSIX_FADV_DONTNEED)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def format_tables(res: dict[str, Any]) -> str:
    lines: list[str] = []
    if "paths" in res:
        lines += [f"{'data path':<52} {'GB/s':>7} {'ceiling':>8} {'ratio':>6}"]
        for k, v in res["paths"].items():
            lines.append(f"{k:<52} {v['gbps']:>7.2f} {v['ceiling_gbps']:>8.2f} {v['ratio']:>6.2f}")
    if "engine" in res:
        e = res["engine"]
        lines += ["", f"engine: {e['model']}", "store (ms until the KV of the prompt is stored, beyond the prefill):",
                  f"{'context':>7} {'KV MB':>6} {'recompute':>9} | {'Example':>8} {'dtkv':>6} {'x':>5} | "
                  f"{'dtkv engine':>11} {'x':>5}",
                  f"{'':>7} {'':>6} {'TTFT ms':>9} | {'(hooks)':>8} {'durable':>6} {'':>5} | {'(hooks)':>11} {'':>5}"]
        for r in e["rows"]:
            lines.append(f"{r['context_tokens']:>7} {r['kv_mb']:>6.1f} {r['recompute_ms']:>9.0f} | "
                         f"{r['example_store_ms']:>8.1f} {r['dtkv_store_ms']:>6.1f} {r['store_speedup']:>4.1f}x | "
                         f"{r['dtkv_save_hook_ms']:>11.1f} {r['store_engine_speedup']:>4.1f}x")
        lines += ["restore (fresh engine process; Example cold = its files dropped from the page cache; "
                  "dtkv = SSD tier, O_DIRECT):",
                  f"{'context':>7} | {'TTFT ms':^32} {'x':>5} | {'load ms (Ex: hooks)':^22} {'x':>5} | same",
                  f"{'':>7} | {'Ex. cold':>10} {'Ex. warm':>10} {'dtkv':>10} {'':>5} | {'Ex. cold':>10} "
                  f"{'dtkv':>11} {'':>5} | (medians; best request: Ex. cold / dtkv)"]
        for r in e["rows"]:
            same = "yes" if all(r["same_output"].values()) else str(r["same_output"])
            lines.append(f"{r['context_tokens']:>7} | {r['example_restore_ttft_ms']:>10.1f} "
                         f"{r['example_restore_warm_ttft_ms']:>10.1f} {r['dtkv_restore_ttft_ms']:>10.1f} "
                         f"{r['restore_ttft_speedup']:>4.1f}x | {r['example_restore_load_ms']:>10.1f} "
                         f"{r['dtkv_restore_load_ms']:>11.1f} {r['restore_load_speedup']:>4.1f}x | {same} "
                         f"(best {r.get('example_restore_ttft_min_ms', 0):.0f} / "
                         f"{r.get('dtkv_restore_ttft_min_ms', 0):.0f} ms)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.util

    work: Path = args.out if args.out else Path(tempfile.mkdtemp(prefix="dtkv-bench-tiers-"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"cpu_count": os.cpu_count()}
    if not args.skip_raw:
        res.update(raw_paths(args, work))
    if not args.skip_engine:
        if importlib.util.find_spec("vllm") is None:
            res["engine_skipped"] = "vLLM is not installed"
        else:
            res["engine"] = engine_compare(args, work)
    res["output"] = str(work / "tiers.json")
    (work / "tiers.json").write_text(__import__("json").dumps(res, indent=1, default=str))
    return res


def format_result(res: dict[str, Any]) -> str:
    return f"{format_tables(res)}\n\nfull results: {res['output']}"
