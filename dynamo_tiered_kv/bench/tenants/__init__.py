"""tenants: a flooding tenant against per-tenant quotas, what encryption at rest costs, and erasure.

Three measures on real tiers built by ``build_store`` (no engine; the synthetic engine layout of
``restore_store``): ``flood`` (``flood.py``: each well-behaved tenant's hit rate with a tenant
flooding the shared tiers, against the same workload without it, quotas on and off; what each
tenant holds and retains per tier), ``crypto`` (``crypto.py``: restore and write with encryption
on against off, and the raw cipher rate) and ``erasure`` (``erasure.py``: ``dtkv tenants erase``
against a running node and a new process on a second node's view; the erased tenant's bytes left
readable anywhere). ``--measures`` picks them (default flood and crypto; ``--erasure`` is
``--measures erasure``); ``--quick`` runs them at small sizes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

from ...errors import ConfigError
from .._shapes import SHAPES
from ..report import progress, table
from .crypto import run_crypto
from .erasure import format_erasure, run_erasure
from .flood import BLOCK_TOKENS, parse_weights, run_flood

__all__ = ["add_arguments", "format_result", "run"]

MEASURES = ("flood", "crypto", "erasure")
DEFAULT_MEASURES = "flood,crypto"
#: what ``--quick`` sets (each still overridable only by dropping --quick)
QUICK = {"sessions": 2, "blocks": 4, "turns": 8, "flood_x": 1.5, "tokens": "256,1024", "rounds": 1,
         "cipher_mib": 16, "erase_blocks": 4, "erase_refresh_s": 1.0, "erase_runs": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measures", default=None, help=f"comma list of {', '.join(MEASURES)} (default {DEFAULT_MEASURES})")
    p.add_argument("--erasure", action="store_true", help="measure erasure: --measures erasure, or added to --measures")
    p.add_argument("--tenants", type=int, default=4, help="tenants, 2-8; the last one floods")
    p.add_argument("--weights", default=None,
                   help="comma list, one per well-behaved tenant: its working set is weight x --sessions "
                        "sessions (default 1,2,1,2...)")
    p.add_argument("--sessions", type=int, default=6, help="sessions of a weight-1 tenant")
    p.add_argument("--blocks", type=int, default=8, help="blocks per session (16 tokens each)")
    p.add_argument("--turns", type=int, default=48, help="measured turns (one revisit per tenant each)")
    p.add_argument("--share", type=float, default=None,
                   help="tenant_default_share of the runs with quotas (default 1/N)")
    p.add_argument("--fill", type=float, default=0.6,
                   help="the largest working set over its host quota (--share of the host tier); sizes the tiers")
    p.add_argument("--flood-x", type=float, default=2.0,
                   help="the flooder writes this many times the three tiers' capacities over the run")
    p.add_argument("--zipf", type=float, default=1.0, help="session j is revisited with weight 1/(j+1)^zipf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2-7b-ish", help="layers, KV heads, head size")
    p.add_argument("--tokens", default="2048,8192", help="crypto: comma list of restore sizes in tokens")
    p.add_argument("--rounds", type=int, default=3, help="crypto: interleaved rounds (after one warm-up)")
    p.add_argument("--cipher-mib", type=int, default=256, help="crypto: bytes of the raw seal/open run")
    p.add_argument("--ssd-io", choices=["auto", "nixl", "odirect"], default="auto", help="SSD tier I/O path")
    p.add_argument("--erase-blocks", type=int, default=64, help="erasure: blocks of each of the two tenants")
    p.add_argument("--erase-refresh-s", type=float, default=30.0,
                   help="erasure: the nodes' object_refresh_s (how often they see erasure markers)")
    p.add_argument("--erase-runs", type=int, default=3, help="erasure: runs, each with encryption off and on")
    p.add_argument("--erase-timeout-s", type=float, default=300.0,
                   help="erasure: longest wait for a node to be clean (a run past it reports no time)")
    p.add_argument("--erase-bucket", choices=["dir", "moto"], default="dir",
                   help="erasure: the bucket without --s3-endpoint: a local directory or a moto server")
    p.add_argument("--s3-endpoint", default=None,
                   help="object tier on S3 at this endpoint (bucket $DTKV_S3_BUCKET or dtkv-bench); "
                        "default: a local directory")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 round (seconds; for tests)")


def _check(args: argparse.Namespace) -> list[str]:
    given = args.measures if args.measures is not None else ("" if args.erasure else DEFAULT_MEASURES)
    measures = [m.strip() for m in given.split(",") if m.strip()]
    if args.erasure and "erasure" not in measures:
        measures.append("erasure")
    bad = sorted(set(measures) - set(MEASURES))
    if bad or not measures:
        raise ConfigError(f"--measures: choose from {', '.join(MEASURES)}, got {args.measures!r}")
    if args.erase_blocks < 1 or args.erase_runs < 1:
        raise ConfigError("--erase-blocks and --erase-runs must be at least 1")
    if not args.erase_refresh_s > 0 or not args.erase_timeout_s > 0:
        raise ConfigError("--erase-refresh-s and --erase-timeout-s must be positive")
    if not 2 <= args.tenants <= 8:
        raise ConfigError(f"--tenants must be 2-8, got {args.tenants}")
    if args.share is not None and not 0 < args.share < 1:
        raise ConfigError(f"--share must be in (0, 1), got {args.share}")
    if not 0 < args.fill <= 1:
        raise ConfigError(f"--fill must be in (0, 1], got {args.fill}")
    if min(args.sessions, args.blocks, args.turns, args.rounds) < 1:
        raise ConfigError("--sessions, --blocks, --turns and --rounds must be at least 1")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < BLOCK_TOKENS:
        raise ConfigError(f"--tokens: comma list of sizes of at least one block ({BLOCK_TOKENS} tokens), "
                          f"got {args.tokens!r}")
    parse_weights(args)
    return measures


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    measures = _check(args)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"load_avg_start": list(os.getloadavg()), "cpus": os.cpu_count(), "quick": args.quick}
    progress("tenants", f"load average {' '.join(f'{x:.2f}' for x in out['load_avg_start'])}")
    with tempfile.TemporaryDirectory(prefix="dtkv-tenants-") as root:
        if "flood" in measures:
            os.makedirs(os.path.join(root, "flood"))
            out["flood"] = run_flood(args, os.path.join(root, "flood"))
        if "crypto" in measures:
            os.makedirs(os.path.join(root, "crypto"))
            out["crypto"] = run_crypto(args, os.path.join(root, "crypto"))
        if "erasure" in measures:
            os.makedirs(os.path.join(root, "erasure"))
            out["erasure"] = run_erasure(args, os.path.join(root, "erasure"))
    out["load_avg_end"] = list(os.getloadavg())
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def _flood_tables(res: dict[str, Any]) -> list[str]:
    runs, ratios, plan = res["runs"], res["ratios"], res["plan"]
    hit_rows, tier_rows = [], []
    for q in ("on", "off"):
        clean = {t["name"]: t for t in runs[f"quotas-{q}-clean"]["tenants"]}
        for t in runs[f"quotas-{q}-flood"]["tenants"]:
            if not t["flooder"]:
                by = t["hits_by_tier"]
                where = " ".join(f"{k} {v / t['blocks']:.2f}" for k, v in sorted(by.items())) if t["blocks"] else "-"
                hit_rows.append([q, t["name"], t["working_set_bytes"] / (1 << 20), clean[t["name"]]["hit_rate"],
                                 t["hit_rate"], ratios[q][t["name"]], where])
            tiers = t["tiers"]
            tier_rows.append([q, t["name"] + (f" ({_mib(t['flood_bytes'])} MiB written)" if t["flooder"] else ""),
                              *(f"{_mib(tiers[n]['bytes'])} / {_mib(tiers[n]['limit'])}" for n in tiers),
                              *(tiers[n]["retained"] / (1 << 20) for n in tiers)])
    names = list(runs["quotas-on-flood"]["tenants"][0]["tiers"])
    caps = plan["capacities"]
    title = (f"flood: {len(plan['tenants'])} tenants, {plan['blocks']} blocks of {plan['record_bytes'] >> 10} KiB "
             f"per session, {plan['turns']} turns, flooder {plan['flood_blocks_per_turn']} blocks per turn, quota "
             f"share {plan['share']:.3g}; tiers "
             + ", ".join(f"{k} {v >> 20} MiB" for k, v in caps.items()))
    goal = res["goal"]
    worst = goal["worst_ratio"]
    line = (f"goal: every other tenant's hit rate with the flooder within 5% of its run without it, quotas on: "
            f"worst ratio {'-' if worst is None else f'{worst:.3f}'} (target >= {goal['target']:.2f}): "
            f"{'met' if goal['met'] else 'MISSED'}")
    drops = ", ".join(f"{k} {v['dropped_batches']}" for k, v in runs.items())
    held = "; ".join(f"quotas {q}: " + ", ".join(
        f"{n} {_mib(u['bytes'])} of {_mib(u['capacity'])} MiB" for n, u in runs[f"quotas-{q}-flood"]["tiers"].items())
        for q in ("on", "off"))
    return [table(["quotas", "tenant", "WS MiB", "hit alone", "hit flooded", "ratio", "hits by tier (flooded)"],
                  hit_rows, title=title, fmts=["", "", ".1f", ".3f", ".3f", ".3f", ""]),
            line,
            table(["quotas", "tenant", *(f"{n} MiB / limit" for n in names), *(f"{n} retained MiB" for n in names)],
                  tier_rows, title="flooded runs at the end: bytes held per tier against the tenant's limit "
                  "('-': the tier does not account by tenant), and retained bytes",
                  fmts=["", "", *[""] * len(names), *[".1f"] * len(names)]),
            f"record bytes held at the end of the flooded runs, all tenants: {held}",
            f"offload batches dropped after retries: {drops}"]


def _crypto_tables(res: dict[str, Any]) -> list[str]:
    rows = [[r["path"], r["tokens"], r["mib"], r["off_ms"], r["on_ms"], r["off_gbps"], r["on_gbps"],
             r["ratio_median"], f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"] for r in res["rows"]]
    raw = res["raw_cipher"]
    goal = res["goal"]
    return [table(["path", "tokens", "MiB", "off ms", "on ms", "off GB/s", "on GB/s", "on/off", "range"], rows,
                  title=f"crypto: encryption on vs off, {res['shape']} ({res['record_bytes'] >> 10} KiB records), "
                  f"objects on {res['object_store']}, median of {res['rounds']} interleaved rounds "
                  "(on/off: median of the rounds' paired throughput ratios, and their range)",
                  fmts=["", "", ".1f", ".1f", ".1f", ".2f", ".2f", ".2f", ""]),
            f"goal: encryption on >= {goal['target']:.1f}x of off on every path: worst {goal['worst_ratio']:.2f}: "
            f"{'met' if goal['met'] else 'MISSED'}",
            f"raw RecordCipher on one thread ({raw['mib']:.0f} MiB of {raw['record_bytes'] >> 10} KiB records): seal "
            f"{raw['seal_gbps']:.2f} GB/s, open {raw['open_gbps']:.2f} GB/s",
            f"records that did not open: {res['open_failures']}"]


def format_result(res: dict[str, Any]) -> str:
    out = [f"load average at start {' '.join(f'{x:.2f}' for x in res['load_avg_start'])}, {res['cpus']} CPUs"]
    if "flood" in res:
        out += _flood_tables(res["flood"])
    if "crypto" in res:
        out += _crypto_tables(res["crypto"])
    if "erasure" in res:
        out += format_erasure(res["erasure"])
    out.append(f"load average at end {' '.join(f'{x:.2f}' for x in res['load_avg_end'])}")
    return "\n\n".join(out)
