"""Tables, summary and PNG plots for ``dtkv bench agentic`` results (pure functions of the result dict)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

TIERS = ("host", "ssd", "object")
#: which session's replay each tier's numbers come from
_SOURCE = {"host": "live", "ssd": "ssd", "object": "object"}
LONG = 8192  # the goal's "contexts of 8k tokens or more"


def _rows(result: dict[str, Any], tier: str) -> list[dict[str, Any]]:
    base = result["sessions"]["recompute"]["replay"]
    rows = []
    for r, b in zip(result["sessions"][_SOURCE[tier]]["replay"], base, strict=True):
        read = sum(r.get("read_bytes", {}).values())
        load_s = r.get("restore_ms", r.get("load_hook_ms", 0.0)) / 1000  # older results: hooks only
        rows.append({"agent": r["agent"], "turn": r["turn"], "context_tokens": r["context_tokens"],
                     "ttft_ms": r["ttft_ms"], "recompute_ms": b["ttft_ms"], "speedup": b["ttft_ms"] / r["ttft_ms"],
                     "reduction": 1 - r["ttft_ms"] / b["ttft_ms"], "restored_tokens": r.get("restored_tokens", 0),
                     "served_blocks": r.get("served_blocks", {}), "read_bytes": read, "load_ms": load_s * 1000,
                     "restore_gbps": read / load_s / 1e9 if load_s > 0 else 0.0,
                     "same_output": r["first_token"] == b["first_token"]})
    return rows


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per-tier aggregates and per-turn rows (also used by the tables and plots)."""
    rec = result["sessions"]["recompute"]["replay"]
    out: dict[str, Any] = {"recompute": {
        "prefill_tokens_per_s": sum(r["context_tokens"] for r in rec) / sum(r["ttft_ms"] / 1000 for r in rec)}}
    for tier in TIERS:
        rows = _rows(result, tier)
        long = [r for r in rows if r["context_tokens"] >= LONG]
        load_s = sum(r["load_ms"] for r in rows) / 1000
        out[tier] = {
            "rows": rows,
            "median_reduction": statistics.median(r["reduction"] for r in rows),
            "long_min_reduction": min((r["reduction"] for r in long), default=None),
            "long_median_reduction": statistics.median(r["reduction"] for r in long) if long else None,
            "long_turns": len(long),
            # context tokens made ready per second of TTFT: the prefill throughput the tier delivers
            "tokens_per_s": sum(r["context_tokens"] for r in rows) / sum(r["ttft_ms"] / 1000 for r in rows),
            "bytes_read": sum(r["read_bytes"] for r in rows),
            "restore_gbps": sum(r["read_bytes"] for r in rows) / load_s / 1e9 if load_s else 0.0,
            "same_output": sum(r["same_output"] for r in rows), "turns": len(rows)}
    live = result["sessions"]["live"]["live"]
    lrows = []
    for t, b in zip(live["turns"], rec, strict=True):
        lrows.append({"agent": t["agent"], "turn": t["turn"], "context_tokens": t["context_tokens"],
                      "ttft_ms": t["ttft_ms"], "recompute_ms": b["ttft_ms"],
                      "restored_tokens": t.get("restored_tokens", 0),
                      "gpu_hit_tokens": t["cached_tokens"] - t.get("restored_tokens", 0),
                      "served_blocks": t.get("served_blocks", {}),
                      "read_bytes": sum(t.get("read_bytes", {}).values())})
    out["live"] = {"rows": lrows, "wall_s": live["wall_s"], "turns_per_min": len(lrows) / live["wall_s"] * 60,
                   "generated_tokens": live["generated_tokens"], "prompt_tokens": live["prompt_tokens"],
                   "ttft_sum_s": sum(r["ttft_ms"] for r in lrows) / 1000,
                   "recompute_sum_s": sum(r["recompute_ms"] for r in lrows) / 1000,
                   "bytes_read": sum(r["read_bytes"] for r in lrows)}
    return out


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The few numbers worth a line each."""
    s = result["summary"]
    h: dict[str, Any] = {"model": result["model"], "object_tier": result["object_tier"]}
    for tier in TIERS:
        t = s[tier]
        if t["long_min_reduction"] is not None:
            h[f"{tier}_ttft_reduction_min_8k"] = round(t["long_min_reduction"], 4)
        h[f"{tier}_ttft_reduction_median"] = round(t["median_reduction"], 4)
        h[f"{tier}_restore_gbps"] = round(t["restore_gbps"], 3)
    h["plots"] = result.get("plots", [])
    return h


def _served(blocks: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(blocks.items())) or "-"


def format_tables(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"model: {result['model']}",
             f"engine KV space: {result['gpu_blocks']} blocks x {result['block_size']} tokens; "
             f"object tier: {result['object_tier']}", "",
             f"live conversations ({result['agents']} agents x {result['turns']} turns, idle {result['idle_s']}s; "
             "turn TTFT = history restored + new tool output prefilled):",
             f"{'agent':>5} {'turn':>4} {'context':>7} {'TTFT':>9} {'recompute':>10} {'restored':>8} "
             f"{'gpu hit':>7} {'MB read':>8}  served by"]
    for r in s["live"]["rows"]:
        lines.append(f"{r['agent']:>5} {r['turn']:>4} {r['context_tokens']:>7} {r['ttft_ms']:>6.0f} ms "
                     f"{r['recompute_ms']:>7.0f} ms {r['restored_tokens']:>8} {r['gpu_hit_tokens']:>7} "
                     f"{r['read_bytes'] / 1e6:>8.1f}  {_served(r['served_blocks'])}")
    lv = s["live"]
    lines.append(f"live: {lv['wall_s']:.1f}s wall, {lv['turns_per_min']:.1f} turns/min, "
                 f"sum TTFT {lv['ttft_sum_s']:.1f}s vs {lv['recompute_sum_s']:.1f}s recomputing, "
                 f"{lv['bytes_read'] / 1e6:.0f} MB restored")
    lines += ["", "full-context restore per tier (engine prefix cache emptied before each request):",
              f"{'tier':>6} {'agent':>5} {'turn':>4} {'context':>7} {'recompute':>10} {'TTFT':>9} {'speedup':>7} "
              f"{'-TTFT':>7} {'MB read':>8} {'restore':>7} {'GB/s':>5} {'same':>4}  served by"]
    for tier in TIERS:
        for r in s[tier]["rows"]:
            lines.append(f"{tier:>6} {r['agent']:>5} {r['turn']:>4} {r['context_tokens']:>7} "
                         f"{r['recompute_ms']:>7.0f} ms {r['ttft_ms']:>6.0f} ms {r['speedup']:>6.1f}x "
                         f"{r['reduction']:>6.1%} "
                         f"{r['read_bytes'] / 1e6:>8.1f} {r['load_ms']:>4.0f} ms {r['restore_gbps']:>5.2f} "
                         f"{'yes' if r['same_output'] else 'NO':>4}  {_served(r['served_blocks'])}")
    lines += ["", f"{'tier':>9} {'turns':>5} {'median -TTFT':>12} {'min -TTFT >=8k':>14} {'tokens/s':>9} "
                  f"{'MB read':>8} {'GB/s':>5} {'same output':>11}",
              f"{'recompute':>9} {len(s['host']['rows']):>5} {'-':>12} {'-':>14} "
              f"{s['recompute']['prefill_tokens_per_s']:>9.0f}"]
    for tier in TIERS:
        t = s[tier]
        lm = f"{t['long_min_reduction']:.1%} ({t['long_turns']})" if t["long_min_reduction"] is not None else "-"
        lines.append(f"{tier:>9} {t['turns']:>5} {t['median_reduction']:>12.1%} {lm:>14} {t['tokens_per_s']:>9.0f} "
                     f"{t['bytes_read'] / 1e6:>8.0f} {t['restore_gbps']:>5.2f} {t['same_output']:>5}/{t['turns']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """``agentic_ttft.png`` (TTFT vs context, log scale) and ``agentic_speedup.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    colors = {"recompute": "tab:red", "host": "tab:green", "ssd": "tab:blue", "object": "tab:purple"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rec = sorted((r["context_tokens"], r["recompute_ms"]) for r in s["host"]["rows"])
    ax.plot([c for c, _ in rec], [t for _, t in rec], "o-", color=colors["recompute"], label="recompute")
    for tier in TIERS:
        pts = sorted((r["context_tokens"], r["ttft_ms"]) for r in s[tier]["rows"])
        ax.plot([c for c, _ in pts], [t for _, t in pts], "o-", color=colors[tier], label=f"restore from {tier}")
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_title("vLLM CPU engine: TTFT recompute vs restore per tier")
    ax.axvline(LONG, color="gray", ls=":", lw=1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p1 = out_dir / "agentic_ttft.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tier in TIERS:
        pts = sorted((r["context_tokens"], r["speedup"]) for r in s[tier]["rows"])
        ax.plot([c for c, _ in pts], [v for _, v in pts], "o-", color=colors[tier], label=tier)
    ax.axhline(20, color="gray", ls="--", lw=1, label="95% lower TTFT (20x)")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("speedup over recompute (x)")
    ax.set_title("TTFT speedup of restore over recompute, per tier")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p2 = out_dir / "agentic_speedup.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def markdown(result: dict[str, Any]) -> str:
    """The summary and per-tier tables as GitHub markdown (what docs/BENCHMARKS.md quotes)."""
    s = result["summary"]
    out = ["| tier | turns | median TTFT reduction | min reduction, contexts >= 8k | context tokens/s of TTFT "
           "| MB read | restore GB/s (store loads) | same first token |", "|---|---|---|---|---|---|---|---|",
           f"| recompute | {len(s['host']['rows'])} | - | - | {s['recompute']['prefill_tokens_per_s']:.0f} "
           "| - | - | - |"]
    for tier in TIERS:
        t = s[tier]
        lm = f"{t['long_min_reduction']:.1%} ({t['long_turns']} turns)" if t["long_min_reduction"] is not None else "-"
        out.append(f"| {tier} | {t['turns']} | {t['median_reduction']:.1%} | {lm} | {t['tokens_per_s']:.0f} | "
                   f"{t['bytes_read'] / 1e6:.0f} | {t['restore_gbps']:.2f} | {t['same_output']}/{t['turns']} |")
    out += ["", "| agent | turn | context | recompute ms | host ms | SSD ms | object ms | host x | SSD x | object x "
                "| MB restored |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for h, d, o in zip(s["host"]["rows"], s["ssd"]["rows"], s["object"]["rows"], strict=True):
        out.append(f"| {h['agent']} | {h['turn']} | {h['context_tokens']} | {h['recompute_ms']:.0f} | "
                   f"{h['ttft_ms']:.0f} | {d['ttft_ms']:.0f} | {o['ttft_ms']:.0f} | {h['speedup']:.1f} | "
                   f"{d['speedup']:.1f} | {o['speedup']:.1f} | {h['read_bytes'] / 1e6:.1f} |")
    lv = s["live"]
    out += ["", "| agent | turn | context | TTFT ms (tiers) | TTFT ms (recompute) | restored tokens | engine-cache "
                "hit tokens | served by |", "|---|---|---|---|---|---|---|---|"]
    for r in lv["rows"]:
        out.append(f"| {r['agent']} | {r['turn']} | {r['context_tokens']} | {r['ttft_ms']:.0f} | "
                   f"{r['recompute_ms']:.0f} | {r['restored_tokens']} | {r['gpu_hit_tokens']} | "
                   f"{_served(r['served_blocks'])} |")
    out.append(f"\nLive session: {lv['wall_s']:.1f} s wall for {len(lv['rows'])} turns ({lv['turns_per_min']:.1f} "
               f"turns/min, idle gaps included); sum of TTFT {lv['ttft_sum_s']:.1f} s with the tiers vs "
               f"{lv['recompute_sum_s']:.1f} s recomputing; {lv['bytes_read'] / 1e6:.0f} MB restored.")
    return "\n".join(out)
