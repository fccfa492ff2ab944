"""Summary and tables of ``dtkv bench restore`` (pure functions over the sessions' results)."""

from __future__ import annotations

import statistics
from typing import Any

TIERS = ("host", "ssd", "object")
RAW_DESC = {"memcpy": "memcpy", "odirect": "O_DIRECT preadv", "s3": "ranged GETs"}
#: (tier, ours/raw ceiling): the restore goals
RAW_TARGETS = {"host": 2.0, "ssd": 1.25, "object": 1.25}
REDUCTION_TARGETS = {"ssd": 0.98, "object": 0.96}
EXAMPLE_TARGET = 2.0


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ttft(sess: dict[str, Any], which: str) -> float | None:
    return _med([r[which]["ttft_ms"] for r in sess["rounds"] if which in r])


def _overheads(sess: dict[str, Any]) -> list[float]:
    """Per round: TTFT of the long prompt restored minus the same prompt from vLLM's own prefix cache
    (same computed tail over the same context): what the restore itself cost the request."""
    return [r["long"]["ttft_ms"] - r["resident"]["ttft_ms"] for r in sess["rounds"] if "resident" in r]


def _cpu_per_gb(sess: dict[str, Any]) -> list[float]:
    """Per round: CPU ms per GB restored, over what the same prompt costs from vLLM's own prefix
    cache (the restored request's CPU minus the prefix-cache request's: the restore's own CPU)."""
    out = []
    for r in sess["rounds"]:
        long, res = r["long"], r.get("resident")
        nbytes = sum(long.get("read_bytes", {}).values())
        if res is None or not nbytes or long.get("cpu_ms") is None or res.get("cpu_ms") is None:
            continue
        out.append((long["cpu_ms"] - res["cpu_ms"]) / (nbytes / 1e9))
    return out


def _same_first_token(sess: dict[str, Any]) -> tuple[int, int]:
    """(rounds whose restored first token equals the prefix-cache one, rounds compared)."""
    pairs = [(r["long"]["first_token"], r["resident"]["first_token"]) for r in sess["rounds"] if "resident" in r]
    return sum(a == b for a, b in pairs), len(pairs)


def _stages(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Median over rounds of the long restore's stages, in ms (None if the store reports none)."""
    st = [r["long"].get("stages") for r in rounds if r["long"].get("stages")]
    if not st:
        return None
    out: dict[str, Any] = {k: _med([s[k] * 1000 for s in st]) for k in ("wait_s", "decode_s", "total_s")}
    out = {k.replace("_s", "_ms"): v for k, v in out.items()}
    tiers = sorted({t for s in st for t in s["read_s"]})
    out["read_ms"] = {t: _med([s["read_s"].get(t, 0.0) * 1000 for s in st]) for t in tiers}
    out["read_mb"] = {t: _med([s["read_bytes"].get(t, 0) / 1e6 for s in st]) for t in tiers}
    out["chunks"] = _med([s["chunks"] for s in st])
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    sess = res["sessions"]
    out: dict[str, Any] = {"rows": []}
    rec = sess.get("recompute")
    rec_long = _ttft(rec, "long") if rec else None
    out["recompute"] = {"long_ttft_ms": rec_long, "short_ttft_ms": _ttft(rec, "short") if rec else None}
    ex = sess.get("example")
    if ex:
        el, es = _ttft(ex, "long"), _ttft(ex, "short")
        out["example"] = {"long_ttft_ms": el, "short_ttft_ms": es, "marginal_ms": el - es,  # type: ignore[operator]
                          "resident_ttft_ms": _ttft(ex, "resident"), "overhead_ms": _med(_overheads(ex)),
                          "restored_tokens": _med([r["long"]["cached_tokens"] for r in ex["rounds"]]),
                          "load_hook_ms": _med([r["long"]["load_hook_ms"] for r in ex["rounds"]])}
    for tier in TIERS:
        s = sess.get(tier)
        if not s or not s["rounds"]:
            continue
        long, short = _ttft(s, "long"), _ttft(s, "short")
        assert long is not None and short is not None
        raw_ms = _med([x * 1000 for x in s.get("raw", []) if x is not None])
        row: dict[str, Any] = {
            "tier": tier, "long_ttft_ms": long, "short_ttft_ms": short, "marginal_ms": long - short,
            "marginal_rounds_ms": [r["long"]["ttft_ms"] - r["short"]["ttft_ms"] for r in s["rounds"]],
            "restored_tokens": _med([r["long"]["cached_tokens"] for r in s["rounds"]]),
            "served_blocks": s["rounds"][-1]["long"].get("served_blocks", {}),
            "load_hook_ms": _med([r["long"]["load_hook_ms"] for r in s["rounds"]]),
            "raw_ms": raw_ms, "raw_rounds_ms": [x * 1000 for x in s.get("raw", []) if x is not None],
            "raw_kind": RAW_DESC.get(s.get("raw_kind", ""), ""), "raw_bytes": s.get("raw_bytes"),
            "stages": _stages(s["rounds"]), "resident_ttft_ms": _ttft(s, "resident"),
            "overhead_rounds_ms": _overheads(s), "same_first_token": _same_first_token(s)}
        row["overhead_ms"] = _med(row["overhead_rounds_ms"])
        row["cpu_ms_per_gb_rounds"] = _cpu_per_gb(s)
        row["cpu_ms_per_gb"] = _med(row["cpu_ms_per_gb_rounds"])
        # the request's wait in the engine for its restore (submission -> runnable): the restore as
        # the engine sees it, without the TTFT's forward-pass noise
        row["engine_wait_ms"] = _med([r["long"].get("engine_wait_ms") for r in s["rounds"]])
        row["engine_wait_ratio_raw"] = row["engine_wait_ms"] / raw_ms if raw_ms and row["engine_wait_ms"] else None
        ok = row["marginal_ms"] > 0  # <= 0: the restore is below this run's request-to-request noise
        ovh = row["overhead_ms"] if row["overhead_ms"] and row["overhead_ms"] > 0 else None
        row["ratio_raw"] = row["marginal_ms"] / raw_ms if raw_ms and ok else None
        row["overhead_ratio_raw"] = ovh / raw_ms if raw_ms and ovh else None
        row["reduction_vs_recompute"] = 1 - long / rec_long if rec_long else None
        # the ceiling: the same prompt from vLLM's own prefix cache (nothing to restore)
        res_ttft = row["resident_ttft_ms"]
        row["prefix_cache_reduction"] = 1 - res_ttft / rec_long if rec_long and res_ttft else None
        # the store's own time for the long restore (LoadResult.stages.total) against the same raw read
        st_total = row["stages"]["total_ms"] if row["stages"] else None
        row["store_total_ms"] = st_total
        row["store_ratio_raw"] = st_total / raw_ms if st_total and raw_ms else None
        if ex:
            row["example_over_ours_marginal"] = out["example"]["marginal_ms"] / row["marginal_ms"] if ok else None
            row["example_over_ours_ttft"] = out["example"]["long_ttft_ms"] / long
            ex_ovh = out["example"]["overhead_ms"]
            # ExampleConnector restores synchronously in its load hooks: that is its restore wait
            ex_wait, wait = out["example"]["load_hook_ms"], row["engine_wait_ms"]
            row["example_over_ours_wait"] = ex_wait / wait if ex_wait and wait else None
            row["example_over_ours_overhead"] = ex_ovh / ovh if ex_ovh and ovh else None
        out["rows"].append(row)
    out["targets"] = targets(out, res.get("object_tier", ""))
    out["sweep"] = sweep_rows(res)
    return out


def _size_keys(res: dict[str, Any], size: int) -> tuple[str, str]:
    """(restored, prefix-cache) record names of prompt size ``size`` in a session's rounds."""
    return ("long", "resident") if size == res["context_tokens"] else (f"sweep:{size}", f"sweep_resident:{size}")


def _size_overhead(sess: dict[str, Any], k: str, kr: str) -> float | None:
    return _med([r[k]["ttft_ms"] - r[kr]["ttft_ms"] for r in sess["rounds"] if k in r and kr in r])


def sweep_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per tier and prompt size (``--sizes``): restore overhead, wait in the engine, raw read, the
    ratios between them and ExampleConnector's overhead / ours; how the restores ran."""
    sess = res["sessions"]
    ex = sess.get("example")
    out: list[dict[str, Any]] = []
    for size in res.get("sizes") or []:
        k, kr = _size_keys(res, size)
        ex_ovh = _size_overhead(ex, k, kr) if ex else None
        # ExampleConnector restores synchronously in its load hooks: that is its restore wait
        ex_wait = _med([r[k]["load_hook_ms"] for r in ex["rounds"] if k in r]) if ex else None
        for tier in TIERS:
            s = sess.get(tier)
            if not s or not s["rounds"] or k not in s["rounds"][0]:
                continue
            raws = s.get("raw", []) if k == "long" else s.get("sweep_raw", {}).get(str(size), [])
            raw_ms = _med([x * 1000 for x in raws if x is not None])
            ovh = _size_overhead(s, k, kr)
            wait = _med([r[k].get("engine_wait_ms") for r in s["rounds"]])
            reps = [x for r in s["rounds"] for x in r[k].get("restore_reports") or []]
            st = _stages([{"long": r[k]} for r in s["rounds"]])
            out.append({
                "tier": tier, "size": size, "restored_tokens": _med([r[k]["cached_tokens"] for r in s["rounds"]]),
                "overhead_ms": ovh, "engine_wait_ms": wait, "raw_ms": raw_ms,
                "raw_kind": RAW_DESC.get(s.get("raw_kind", ""), ""),
                "overhead_ratio_raw": ovh / raw_ms if ovh is not None and ovh > 0 and raw_ms else None,
                "engine_wait_ratio_raw": wait / raw_ms if wait and raw_ms else None,
                "example_overhead_ms": ex_ovh,
                "example_over_ours_overhead": ex_ovh / ovh if ex_ovh and ovh and ovh > 0 else None,
                "example_wait_ms": ex_wait, "example_over_ours_wait": ex_wait / wait if ex_wait and wait else None,
                "sync": sum(bool(x.get("sync")) for x in reps), "restores": len(reps),
                "steps_pending": _med([x["steps"] for x in reps if not x.get("sync") and x.get("steps") is not None]),
                "store_total_ms": st["total_ms"] if st else None, "chunks": st["chunks"] if st else None})
    return out


def format_sweep(res: dict[str, Any]) -> list[str]:
    rows = res["summary"].get("sweep") or []
    if not rows:
        return []
    lines = ["", "size sweep (same sessions; medians of the rounds): overhead = TTFT restored - TTFT from vLLM's "
             "prefix cache; in engine: the request's wait for its restore; Ex/ours: ExampleConnector's cold "
             "overhead / ours, and its load hooks / our wait in the engine (wait); sync: restores run "
             "synchronously in their step; steps: engine steps an async restore was pending",
             f"{'tier':<7} {'size':>6} {'restored':>8} {'raw ms':>7} {'overhead':>8} {'ovh/raw':>7} "
             f"{'in engine':>9} {'/raw':>6} {'store':>6} {'chunks':>6} {'Ex ovh':>7} {'Ex/ours':>7} "
             f"{'Ex hooks':>8} {'(wait)':>6} {'sync':>5} {'steps':>5}"]
    for r in rows:
        lines.append(f"{r['tier']:<7} {r['size']:>6} {_f(r['restored_tokens'], '.0f'):>8} {_f(r['raw_ms']):>7} "
                     f"{_f(r['overhead_ms']):>8} {_f(r['overhead_ratio_raw'], '.2f'):>6}x "
                     f"{_f(r['engine_wait_ms']):>9} {_f(r['engine_wait_ratio_raw'], '.2f'):>5}x "
                     f"{_f(r['store_total_ms']):>6} {_f(r['chunks'], '.0f'):>6} {_f(r['example_overhead_ms']):>7} "
                     f"{_f(r['example_over_ours_overhead'], '.2f'):>6}x {_f(r['example_wait_ms']):>8} "
                     f"{_f(r['example_over_ours_wait'], '.2f'):>5}x {r['sync']:>2}/{r['restores']:<2} "
                     f"{_f(r['steps_pending'], '.0f'):>5}")
    return lines


def targets(s: dict[str, Any], obj_desc: str) -> list[dict[str, Any]]:
    """The restore goals against what this run measured."""
    rows = {r["tier"]: r for r in s["rows"]}
    out: list[dict[str, Any]] = []
    for tier, lim in RAW_TARGETS.items():
        r = rows.get(tier)
        if r and r["ratio_raw"] is not None:
            out.append({"goal": f"{tier} marginal restore (long - short) <= {lim}x {r['raw_kind']}",
                        "measured": r["ratio_raw"], "fmt": "x", "met": r["ratio_raw"] <= lim})
        if r and r.get("engine_wait_ratio_raw") is not None:
            out.append({"goal": f"{tier} restore wait in the engine <= {lim}x {r['raw_kind']}",
                        "measured": r["engine_wait_ratio_raw"], "fmt": "x", "met": r["engine_wait_ratio_raw"] <= lim})
        if r and r.get("overhead_ratio_raw") is not None:
            out.append({"goal": f"{tier} restore overhead (restored - prefix cache) <= {lim}x {r['raw_kind']}",
                        "measured": r["overhead_ratio_raw"], "fmt": "x", "met": r["overhead_ratio_raw"] <= lim})
    r = rows.get("ssd")
    if r and r.get("example_over_ours_wait") is not None:
        out.append({"goal": f">= {EXAMPLE_TARGET}x faster than ExampleConnector cold restore (SSD, restore wait: "
                            "its load hooks / our wait in the engine)",
                    "measured": r["example_over_ours_wait"], "fmt": "x",
                    "met": r["example_over_ours_wait"] >= EXAMPLE_TARGET})
    if r and r.get("example_over_ours_overhead") is not None:
        out.append({"goal": f">= {EXAMPLE_TARGET}x faster than ExampleConnector cold restore (SSD, overhead)",
                    "measured": r["example_over_ours_overhead"], "fmt": "x",
                    "met": r["example_over_ours_overhead"] >= EXAMPLE_TARGET})
    if r and r.get("example_over_ours_marginal") is not None:
        out.append({"goal": f">= {EXAMPLE_TARGET}x faster than ExampleConnector cold restore (SSD, marginal)",
                    "measured": r["example_over_ours_marginal"], "fmt": "x",
                    "met": r["example_over_ours_marginal"] >= EXAMPLE_TARGET})
        out.append({"goal": f">= {EXAMPLE_TARGET}x faster than ExampleConnector cold restore (SSD, TTFT)",
                    "measured": r["example_over_ours_ttft"], "fmt": "x",
                    "met": r["example_over_ours_ttft"] >= EXAMPLE_TARGET})
    for tier, lim in REDUCTION_TARGETS.items():
        r = rows.get(tier)
        if r and r["reduction_vs_recompute"] is not None:
            what = f" ({obj_desc.split(' (')[0]})" if tier == "object" else ""
            ceiling = r.get("prefix_cache_reduction")
            what += f" [vLLM's own prefix cache: {ceiling:.1%}]" if ceiling is not None else ""
            out.append({"goal": f"TTFT reduction vs recompute, {tier}{what} >= {lim:.0%}",
                        "measured": r["reduction_vs_recompute"], "fmt": "%",
                        "met": r["reduction_vs_recompute"] >= lim})
    return out


def _f(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def format_tables(res: dict[str, Any]) -> str:
    s = res["summary"]
    kv = res["kv_bytes_per_token"]
    lines = [f"engine: {res['model']}",
             f"prompt {res['context_tokens']} tokens, short {res['short_tokens']}, block {res['block_size']}; "
             f"object tier: {res['object_tier']}; raw reads: {res['raw_chunk_bytes'] >> 10} KiB x "
             f"{res['raw_depth']} in flight; medians of {res['rounds']} rounds",
             "",
             "TTFT long: the long prompt restored; cached: the same prompt from vLLM's own prefix cache;",
             "marginal = long - short; overhead = long - cached (the restore's own cost); same 1st: restored "
             "first token equals the prefix-cache one",
             "",
             f"{'tier':<7} {'restored':>8} {'MiB':>5} {'TTFT long':>9} {'cached':>6} {'short':>6} {'marginal':>8} "
             f"{'overhead':>8} | {'raw ms':>7} {'raw':<15} {'marg/raw':>8} {'ovh/raw':>7} | {'vs recomp.':>10} "
             f"{'Ex/ours':>7} {'(TTFT)':>6} {'same 1st':>8}"]
    for r in s["rows"]:
        same = r.get("same_first_token") or (0, 0)
        lines.append(f"{r['tier']:<7} {_f(r['restored_tokens'], '.0f'):>8} "
                     f"{_f((r['restored_tokens'] or 0) * kv / 2**20):>5} {r['long_ttft_ms']:>9.1f} "
                     f"{_f(r.get('resident_ttft_ms')):>6} {r['short_ttft_ms']:>6.1f} {r['marginal_ms']:>8.1f} "
                     f"{_f(r.get('overhead_ms')):>8} | {_f(r['raw_ms']):>7} "
                     f"{r['raw_kind']:<15} {_f(r['ratio_raw'], '.2f'):>7}x "
                     f"{_f(r.get('overhead_ratio_raw'), '.2f'):>6}x | "
                     f"{_f(r['reduction_vs_recompute'] and r['reduction_vs_recompute'] * 100):>9}% "
                     f"{_f(r.get('example_over_ours_overhead'), '.2f'):>6}x "
                     f"{_f(r.get('example_over_ours_ttft'), '.2f'):>5}x {same[0]:>5}/{same[1]}")
    rc, ex = s["recompute"], s.get("example")
    lines.append(f"{'recomp.':<7} {'0':>8} {'':>5} {_f(rc['long_ttft_ms']):>9} {_f(rc['short_ttft_ms']):>6}")
    if ex:
        lines.append(f"{'Example':<7} {_f(ex['restored_tokens'], '.0f'):>8} "
                     f"{_f((ex['restored_tokens'] or 0) * kv / 2**20):>5} {ex['long_ttft_ms']:>9.1f} "
                     f"{_f(ex.get('resident_ttft_ms')):>6} {ex['short_ttft_ms']:>6.1f} {ex['marginal_ms']:>8.1f} "
                     f"{_f(ex.get('overhead_ms')):>8} | (cold: files dropped from the page "
                     f"cache; load hooks {ex['load_hook_ms']:.1f} ms)")
    staged = [r for r in s["rows"] if r["stages"]]
    if staged:
        lines += ["", "store restore stages of the long prompt (LoadResult.stages, ms; total / raw read); in engine: "
                  "the request's wait for its restore,",
                  "submission to runnable (Ex/ours: ExampleConnector's load hooks / that wait); CPU ms/GB: the "
                  "process's CPU for the",
                  "restored request over the prefix-cache one, per GB restored:",
                  f"{'tier':<7} {'read':>7} {'MB':>6} {'wait':>7} {'decode':>7} {'total':>7} {'chunks':>6} "
                  f"{'load hooks':>10} {'total/raw':>9} {'in engine':>9} {'/raw':>6} {'Ex/ours':>7} {'CPU ms/GB':>9}"]
        for r in staged:
            st = r["stages"]
            lines.append(f"{r['tier']:<7} {_f(sum(st['read_ms'].values())):>7} {_f(sum(st['read_mb'].values())):>6} "
                         f"{_f(st['wait_ms']):>7} {_f(st['decode_ms']):>7} {_f(st['total_ms']):>7} "
                         f"{_f(st['chunks'], '.0f'):>6} {_f(r['load_hook_ms']):>10} "
                         f"{_f(r['store_ratio_raw'], '.2f'):>8}x {_f(r.get('engine_wait_ms')):>9} "
                         f"{_f(r.get('engine_wait_ratio_raw'), '.2f'):>5}x "
                         f"{_f(r.get('example_over_ours_wait'), '.2f'):>6}x {_f(r.get('cpu_ms_per_gb'), '.0f'):>9}")
    else:
        lines += ["", "(the store reports no restore stages: breakdown skipped)"]
    lines += format_sweep(res)
    if res.get("busy"):
        lines.append(f"{res['busy']} CPU-bound process(es) ran beside the engine for the whole run")
    if res.get("load_avg"):
        lines.append(f"load average at the end of the run: {' '.join(f'{x:.1f}' for x in res['load_avg'])} "
                     f"({res.get('cpu_count')} CPUs)")
    lines += ["", "targets:"]
    for t in s["targets"]:
        m = f"{t['measured']:.1%}" if t["fmt"] == "%" else f"{t['measured']:.2f}x"
        lines.append(f"  {'met ' if t['met'] else 'MISS'}  {t['goal']}: {m}")
    return "\n".join(lines)
