"""Render a Plan as text tables (what ``dtkv plan`` prints) or as a JSON-ready dict."""

from __future__ import annotations

import math

from .hardware import GIB, PRICES, TIB
from .model import Plan, TierResult, TtftRow
from .spindles import SpindleRow

_BINARY_TIERS = {"HBM", "DRAM"}  # memory is sized in GiB/TiB, drives in GB/TB


def assumptions(p: Plan) -> list[str]:
    """Every assumption behind the numbers, the scenario's own first."""
    s, m = p.scenario, p.scenario.model
    d_qk = m.qk_head_dim or m.head_size
    d_v = m.v_head_dim or m.head_size
    lines = list(s.assumptions)
    lines += [
        "minutes = usable bytes / (tokens/s x bytes/token); HBM holds the engine's raw KV, DRAM/SSD/HDD-S3 "
        f"hold our records ({p.stored_bytes_per_block:,} B per {s.block_size}-token block, headers included)",
        f"prefill FLOPs(T) = 2 x {m.active_params:.3g} x T + {m.layers} x {m.q_heads} x ({d_qk}+{d_v}) x T x (T+1)"
        f"; recompute = FLOPs / (TP x dense bf16 peak x MFU {s.mfu:g})",
        "restore = latency + bytes / min(tier GB/s, TP x host-link GB/s) + compute of the tokens after the last "
        "whole block; loading and compute do not overlap (conservative)",
        f"HBM price = GPU rent (${s.gpu.usd_per_hour:.2f}/h for {s.gpu.name}) / its memory; "
        + "; ".join(f"{k.upper()}: {v.basis}" for k, v in PRICES.items())
        + " (hardware only; override with --price TIER=USD)",
    ]
    lines += [f"{t.name}: {t.note}" for t in p.tiers if t.note]
    lines.append(spindle_assumption(p))
    return lines


def spindle_assumption(p: Plan) -> str:
    m = p.scenario.spindles
    stripe = f"{m.stripe_bytes / 2**20:g} MiB stripes" if m.stripe_bytes else "no striping"
    code = f"{m.data_shards} data shards per stripe (erasure code k={m.data_shards})" if m.data_shards > 1 \
        else "one copy read per stripe (replicated)"
    target = f"{m.target_s * 1e3:g} ms" if m.target_s is not None else \
        f"recompute of the restored tokens on {p.tp} x {p.scenario.gpu.name} (TTFT no worse than recomputing)"
    return (f"HDD spindles: {m.seek_s * 1e3:g} ms per disk op, {m.spindle_gbps * 1e3:g} MB/s streaming per spindle; "
            f"ranged GETs of {m.get_bytes / 2**20:.3g} MiB ({m.requests_per_gb:.1f} per GB), {stripe}, {code}; "
            f"{m.gets_in_flight} GETs in flight per restore, {m.sessions} restore(s) at once; target: {target}")


def _size(nbytes: float, binary: bool) -> str:
    if binary:
        return f"{nbytes / TIB:.2f} TiB" if nbytes >= TIB else f"{nbytes / GIB:.1f} GiB"
    return f"{nbytes / 1e15:.2f} PB" if nbytes >= 1e15 else f"{nbytes / 1e12:.2f} TB"


def _secs(x: float) -> str:
    return f"{x:.3g} s" if x < 100 else f"{x:,.0f} s"


def _minutes(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:,.0f}"


def _money(x: float) -> str:
    if math.isinf(x):
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def _tier_row(t: TierResult) -> list[str]:
    binary = t.name in _BINARY_TIERS
    return [
        t.name,
        _size(t.capacity_bytes, binary),
        _size(t.usable_bytes, binary),
        _minutes(t.minutes),
        f"{t.hours:.2f}",
        f"{t.price_gb_month:.3g}",
        _money(t.usd_month),
        _money(t.usd_month_per_context_hour),
        f"{t.restore_gbps:,.0f}",
    ]


def _ttft_row(r: TtftRow, tiers: list[str]) -> list[str]:
    cells = [r.gpu, str(r.tp), f"{r.tokens:,}", _secs(r.recompute_s)]
    cells += [f"{_secs(r.restore_s[t])} ({round(-100 * r.reduction(t)):+d}%)" for t in tiers]
    cells.append("unreachable" if math.isinf(r.gbps_for_95) else f"{r.gbps_for_95:,.1f}")
    return cells


def _spindle_row(r: SpindleRow) -> list[str]:
    if r.spindles is None:
        need = f" ({r.gets_in_flight_needed} in flight)" if r.gets_in_flight_needed else ""
        spindles, restore, bound = "-", "-", r.bound + need
    else:
        spindles, restore, bound = f"{r.spindles:,}", _secs(r.restore_s or 0.0), r.bound
    return [f"{r.tokens:,}", f"{r.prefix_bytes / 1e9:.3g} GB", _secs(r.target_s), f"{r.requests:,}",
            f"{r.disk_ops:,}", _secs(r.seek_term_s), _secs(r.transfer_term_s), _secs(r.floor_s), spindles, restore,
            bound]


def format_text(p: Plan) -> str:
    """The plan as aligned text tables followed by the assumptions."""
    s, m = p.scenario, p.scenario.model
    rate = s.tokens_per_s * p.kv_bytes_per_token
    attn = "MLA latent" if m.mla else f"{m.kv_heads} KV heads x {m.head_size}"
    copies = m.stored_copies(p.tp, s.mla_one_copy)
    overhead = p.stored_bytes_per_token / (p.kv_bytes_per_token * copies / p.tp) - 1
    out = [
        f"dtkv plan: scenario {s.name}",
        f"model     {m.name}: {m.layers} layers x {attn}, {m.kv_dtype} KV, {m.active_params / 1e9:.3g}B active params",
        f"KV/token  {p.kv_bytes_per_token:,} B raw (HBM, {p.tp} rank{'s' if p.tp > 1 else ''}); "
        f"{p.stored_bytes_per_token:,.0f} B stored "
        f"({p.stored_bytes_per_block:,} B record per {s.block_size}-token block, {overhead:+.2%})",
        f"rate      {s.tokens_per_s:,.0f} tokens/s = {rate / 1e9:.3g} GB/s ({rate / GIB:.3g} GiB/s) of KV "
        f"on {p.tp} x {s.gpu.name} (TP {p.tp})",
        "",
        "Capacity and cost per tier",
    ]
    header = ["tier", "capacity", "usable", "minutes", "hours", "$/GB-mo", "$/month", "$/mo per ctx-h", "GB/s"]
    out += _table(header, [_tier_row(t) for t in p.tiers])
    names = [t.name for t in p.tiers]
    out += [
        "",
        f"TTFT: restore from each tier vs recompute (MFU {s.mfu:g}, dense bf16 peak). Cells: restore TTFT and",
        "its change vs recompute; last column: GB/s a zero-latency tier needs to cut TTFT by 95%",
    ]
    header = ["gpu", "tp", "tokens", "recompute", *names, "GB/s for -95%"]
    out += _table(header, [_ttft_row(r, names) for r in p.ttft])
    if p.spindles:
        out += [
            "",
            "HDD spindles for a restore within the target (per prompt: its restorable prefix as stored records;",
            "bound: latency = seeks dominate the disk time, bandwidth = streaming does, concurrency/request = out of",
            "reach on any number of spindles: more GETs in flight / smaller GETs needed)",
        ]
        header = ["tokens", "prefix", "target", "GETs", "disk ops", "seek disk-s", "stream disk-s", "floor",
                  "spindles", "restore", "bound"]
        out += _table(header, [_spindle_row(r) for r in p.spindles])
    out += ["", "Assumptions", *(f"- {a}" for a in assumptions(p))]
    return "\n".join(out)


def _finite(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


def to_dict(p: Plan) -> dict:
    """The plan as plain JSON types (infinities become null)."""
    s, m = p.scenario, p.scenario.model
    return {
        "scenario": s.name,
        "model": {
            "name": m.name,
            "layers": m.layers,
            "kv_heads": m.kv_heads,
            "head_size": m.head_size,
            "q_heads": m.q_heads,
            "mla": m.mla,
            "kv_dtype": m.kv_dtype,
            "active_params": m.active_params,
            "weight_bytes": m.weight_bytes,
        },
        "gpu": s.gpu.name,
        "tp": p.tp,
        "tokens_per_s": s.tokens_per_s,
        "block_size": s.block_size,
        "mfu": s.mfu,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "stored_bytes_per_token": p.stored_bytes_per_token,
        "stored_bytes_per_block": p.stored_bytes_per_block,
        "stored_copies_per_block": m.stored_copies(p.tp, s.mla_one_copy),
        "tiers": [
            {
                "name": t.name,
                "capacity_bytes": t.capacity_bytes,
                "usable_bytes": t.usable_bytes,
                "bytes_per_token": t.bytes_per_token,
                "minutes": t.minutes,
                "minutes_raw_kv": t.minutes_raw,
                "hours": t.hours,
                "price_usd_per_gb_month": t.price_gb_month,
                "usd_per_month": t.usd_month,
                "usd_per_month_per_context_hour": _finite(t.usd_month_per_context_hour),
                "restore_gbps": t.restore_gbps,
                "latency_s": t.latency_s,
            }
            for t in p.tiers
        ],
        "ttft": [
            {
                "gpu": r.gpu,
                "tp": r.tp,
                "tokens": r.tokens,
                "restored_tokens": r.restored_tokens,
                "recompute_s": r.recompute_s,
                "restore_s": r.restore_s,
                "restore_bytes": r.restore_bytes,
                "reduction": {k: r.reduction(k) for k in r.restore_s},
                "speedup": {k: r.speedup(k) for k in r.restore_s},
                "gbps_for_95pct_reduction": _finite(r.gbps_for_95),
            }
            for r in p.ttft
        ],
        "spindles": {
            "model": {
                "seek_s": p.scenario.spindles.seek_s,
                "spindle_gbps": p.scenario.spindles.spindle_gbps,
                "get_bytes": p.scenario.spindles.get_bytes,
                "requests_per_gb": p.scenario.spindles.requests_per_gb,
                "stripe_bytes": p.scenario.spindles.stripe_bytes,
                "data_shards": p.scenario.spindles.data_shards,
                "gets_in_flight": p.scenario.spindles.gets_in_flight,
                "sessions": p.scenario.spindles.sessions,
                "target": "given" if p.scenario.spindles.target_s is not None else "recompute",
            },
            "rows": [
                {
                    "tokens": r.tokens,
                    "prefix_bytes": r.prefix_bytes,
                    "target_s": r.target_s,
                    "requests": r.requests,
                    "disk_ops": r.disk_ops,
                    "seek_disk_s": r.seek_term_s,
                    "transfer_disk_s": r.transfer_term_s,
                    "floor_s": r.floor_s,
                    "spindles": r.spindles,
                    "restore_s": r.restore_s,
                    "bound": r.bound,
                    "gets_in_flight_needed": r.gets_in_flight_needed,
                }
                for r in p.spindles
            ],
        },
        "assumptions": assumptions(p),
    }
