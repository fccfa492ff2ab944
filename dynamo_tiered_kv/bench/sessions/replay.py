"""sessions: agent sessions replayed against the real store: recency vs retention hints vs hints + prefetch.

Many sessions of many turns with a growing context (``trace``: AgentX's shape, tokens
scaled down) run against a real ``TieredStore`` (host tier, SSD segment files, a local-directory
object tier), each tier far smaller than the working set, on a simulated clock (think times of
seconds to hours; retention expiry and GC run on that clock, nothing sleeps). Every policy gets
a fresh store and the same trace:

* ``recency``: plain LRU in every tier.
* ``hints``: each turn of a hinted session (``--hinted-share`` of them; the others are plain
  traffic) sends ``kv.retain`` directives (system prompt at a higher priority than the rest,
  ``--retain-s`` long) through ``hints.plan_retention`` into ``TieredStore.retain``; its last
  turn demotes and releases its blocks.
* ``hints+prefetch``: the same, plus a ``dtkv.prefetch`` hint ``--lead-s`` before each resumed
  turn (``TieredStore.prefetch``), so the prefix is back in the host tier when the turn comes.

Per turn the previous context is restored (``TieredStore.load``: wall time measured), what did
not come back is recomputed (written back as the engine would offload it). A GC pass
(``TieredStore.expire``) runs every ``--gc-every-s`` of simulated time and once at the end with
the clock past every retention, after which the bytes of expired blocks left in any tier are
counted (0 expected): for the host and object tiers the logical bytes of expired blocks they
still contain; for the SSD tier the physical bytes, i.e. the filesystem blocks still allocated
(SEEK_DATA/SEEK_HOLE) inside any segment file's records that are either a copy of a block whose
retention passed or dead (named by the tombstone log: in this replay SSD blocks are deleted by
the expiry passes, so these are the blocks every earlier pass expired). The SSD segment files'
allocated bytes (``st_blocks * 512``) before and after that last pass are reported too. Table
on stdout, ``sessions.json`` and ``sessions.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ...blocks.codec import record_bytes
from ...blocks.keys import Namespace, chain_keys, parents_of
from ...blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from ...hints import RetainDirective, plan_retention
from ...staging.slabs import StagingPool
from ...store import TieredStore
from ...tiers.host import HostTier
from ...tiers.objectstore import LocalDirBackend, ObjectTier
from ...tiers.ssd import SSDTier
from ...tiers.ssd.space import allocated_segment_bytes, bytes_held_by
from ..report import percentile, progress, table
from .trace import Session, TraceSpec, events, make_trace, overlap

POLICIES = ("recency", "hints", "hints+prefetch")
BS, LAYERS, HEADS, HEAD = 16, 2, 2, 32
NS = Namespace("bench-sessions", "bfloat16", "VLLM_CPU", BS, LAYERS, HEADS, HEAD)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("dtkv-bench-sessions"), help="directory for the JSON and PNG")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--median-turns", type=int, default=43)
    p.add_argument("--tokens-per-session", type=int, default=142_000, help="before --scale")
    p.add_argument("--scale", type=int, default=128, help="tokens are divided by this (the shape is kept)")
    p.add_argument("--min-pause-s", type=float, default=2.0)
    p.add_argument("--max-pause-s", type=float, default=4 * 3600.0)
    p.add_argument("--retain-s", type=float, default=2 * 3600.0, help="kv.retain duration of each turn")
    p.add_argument("--lead-s", type=float, default=30.0, help="prefetch hint this long before a resumed turn")
    p.add_argument("--gc-every-s", type=float, default=300.0, help="simulated seconds between GC passes")
    p.add_argument("--hinted-share", type=float, default=0.25,
                   help="share of sessions that send hints (the others are plain traffic in every policy)")
    p.add_argument("--host-share", type=float, default=0.05,
                   help="host tier capacity / working set (at least two of the largest contexts)")
    p.add_argument("--ssd-share", type=float, default=0.10)
    p.add_argument("--object-share", type=float, default=0.60)
    p.add_argument("--retain-max-share", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="6 sessions of ~8 turns (seconds; for tests)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG")


class SimClock:
    """Unix-like seconds that only move when the replay says so."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def _layout(num_blocks: int) -> EngineLayout:
    tensors = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=LAYERS, num_blocks=num_blocks,
                                 block_size=BS, num_kv_heads=HEADS, head_size=HEAD)
    return EngineLayout(EngineLayoutKind.VLLM_CPU, tensors, BS, HEADS, HEAD)


def _store(root: Path, caps: dict[str, int], clock: SimClock, share: float, rb: int) -> TieredStore:
    tiers = [HostTier(caps["host"], chunk_bytes=rb, pin=False),
             SSDTier(root / "ssd", capacity_bytes=caps["ssd"], segment_bytes=max(64 << 10, 8 * rb),
                     idle_seal_s=None, fsync=False),
             ObjectTier(LocalDirBackend(root / "obj"), capacity_bytes=caps["object"], ttl_s=None)]
    pool = StagingPool(64 * rb, 8, pin=False)
    store = TieredStore(tiers, NS, pool, write_depth=3, clock=clock, retain_max_share=share)
    store.retention.note_record_bytes(rb)
    return store


def _retain(store: TieredStore, s: Session, keys: list[bytes], ctx: int, now: float, args: argparse.Namespace,
            retained: dict[bytes, float]) -> None:
    """A turn's kv.retain: system prompt at 80, the rest of the context at 50, ``retain_s`` long."""
    directives = (RetainDirective(80, 0, s.system_tokens, args.retain_s),
                  RetainDirective(50, s.system_tokens, None, args.retain_s))
    plan = plan_retention(directives, block_size=BS, num_prompt_tokens=ctx, now=now)
    pairs = plan.assign(keys)
    store.retain([k for k, _ in pairs], [r for _, r in pairs])
    for k, r in pairs:
        retained[k] = r.expiry if r.expiry is not None else float("inf")


def _replay(policy: str, trace: list[Session], args: argparse.Namespace, root: Path, caps: dict[str, int],
            rb: int) -> dict[str, Any]:
    clock = SimClock()
    t0 = clock.t
    hinting, prefetch = policy != "recency", policy == "hints+prefetch"
    every = max(1, round(1 / args.hinted_share)) if args.hinted_share > 0 else 0
    hinted = {s.sid for s in trace if every and s.sid % every == 0}
    store = _store(root, caps, clock, args.retain_max_share, rb)
    keys = {s.sid: chain_keys(NS, s.tokens) for s in trace}
    layout = _layout(max(len(k) for k in keys.values()) + 1)
    sess = {s.sid: s for s in trace}
    todo: list[tuple[float, int, int, int]] = [(t0 + t, 1, sid, turn) for t, sid, turn in events(trace)]
    if prefetch:
        todo += [(t0 + s.at(t) - min(args.lead_s, s.pauses[t] / 2), 0, s.sid, t)
                 for s in trace if s.sid in hinted for t in range(1, s.turns)]
    todo.sort()
    tiers = {"host": 0, "ssd": 0, "object": 0, "miss": 0}
    restore_s: list[float] = []
    ratios: list[float] = []
    resumed = recomputed = within = within_recomputed = 0
    retained: dict[bytes, float] = {}
    gc_bytes = 0
    next_gc = t0 + args.gc_every_s
    try:
        for when, kind, sid, turn in todo:
            while next_gc <= when:
                clock.t = next_gc
                gc_bytes += sum(store.expire().bytes.values())
                next_gc += args.gc_every_s
            clock.t = when
            s = sess[sid]
            prev = s.context(turn - 1) // BS if turn else 0
            if kind == 0:  # the prefetch hint of turn ``turn``
                store.prefetch_now(keys[sid][:prev])
                continue
            ctx = s.context(turn)
            n = ctx // BS
            ks = keys[sid][:n]
            hints = hinting and sid in hinted
            if hints:
                _retain(store, s, ks, ctx, clock.t, args, retained)
            loaded = 0
            if prev:
                res = store.load(layout, list(range(1, prev + 1)), ks[:prev])
                loaded = len(res.loaded_block_ids)
                for name in res.tier_per_block:
                    tiers[name] = tiers.get(name, 0) + 1
                tiers["miss"] += prev - loaded
                resumed += 1
                restore_s.append(res.stages.total_s)
                recomputed += loaded < prev
                if sid in hinted and s.pauses[turn] <= args.retain_s:  # a hinted session, within retention
                    within += 1
                    within_recomputed += loaded < prev
                if prefetch and loaded == prev and set(res.tier_per_block) == {"host"} and res.stages.total_s > 0:
                    store.drain(30)
                    ref = store.load(layout, list(range(1, prev + 1)), ks[:prev])  # a host restore, same bytes
                    if len(ref.loaded_block_ids) == prev and ref.stages.total_s > 0:
                        ratios.append(res.stages.total_s / ref.stages.total_s)
            ids = list(range(1 + loaded, n + 1))
            for a in range(0, len(ids), 32):  # the engine offloads what it computed
                b = a + 32
                while not store.submit_offload(layout, ids[a:b], ks[loaded + a:loaded + b],
                                               parents_of(ks)[loaded + a:loaded + b], first_index=loaded + a):
                    store.drain(30)
            store.drain(30)
            if hints and turn == s.turns - 1:  # the session is over: release and move down
                store.demote(ks)
                for k in ks:
                    retained.pop(k, None)
        clock.t = max([v for v in retained.values() if v != float("inf")] + [clock.t]) + 1
        ssd_before = allocated_segment_bytes(root / "ssd")
        gc_bytes += sum(store.expire().bytes.values())
        ssd_after = allocated_segment_bytes(root / "ssd")
        expired = {k for k, x in retained.items() if x <= clock.t}
        expired_left = {t.name: sum(t.size_of(k) or 0 for k in expired if t.contains(k))
                        for t in store.tiers if t.name != "ssd"}
        expired_left["ssd"] = bytes_held_by(root / "ssd", expired, dead=True)  # physical (module docstring)
        obj = store.tiers[2]
        s3_read = obj.stats.records_read * rb  # type: ignore[attr-defined]
        yielded = sum(store.retention.retention_of(i).yielded for i in range(3))
    finally:
        store.close()
    total = sum(tiers.values()) or 1
    return {
        "policy": policy,
        "hit_rate": {k: v / total for k, v in tiers.items()},
        "resumed_turns": resumed,
        "recompute_share": recomputed / max(1, resumed),
        "within_retention_turns": within,
        "within_retention_recomputes": within_recomputed,
        "restore_p50_ms": 1e3 * percentile(restore_s, 0.5) if restore_s else 0.0,
        "restore_p99_ms": 1e3 * percentile(restore_s, 0.99) if restore_s else 0.0,
        "host_speed_ratio_p50": percentile(ratios, 0.5) if ratios else None,
        "host_speed_turns": len(ratios),
        "s3_bytes_read": s3_read,
        "gc_bytes": gc_bytes,
        "expired_bytes_left": expired_left,
        "ssd_allocated_bytes": {"before_final_gc": ssd_before, "after_final_gc": ssd_after},
        "protection_yields": yielded,
        "prefetch": vars(store.retention.prefetch_stats),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.sessions, args.median_turns, args.tokens_per_session = 6, 8, 48_000
    spec = TraceSpec(args.sessions, args.median_turns, args.tokens_per_session, args.scale, args.min_pause_s,
                     args.max_pause_s, spread_s=args.max_pause_s, seed=args.seed)
    trace = make_trace(spec)
    rb = record_bytes(_layout(1).shape)
    ws = sum(s.context(s.turns - 1) // BS for s in trace) * rb
    largest = max(s.context(s.turns - 1) // BS for s in trace) * rb
    caps = {"host": max(2 * largest, int(ws * args.host_share)), "ssd": max(256 << 10, int(ws * args.ssd_share)),
            "object": max(16 * rb, int(ws * args.object_share))}
    out: dict[str, Any] = {
        "trace": {"sessions": len(trace), "turns": sum(s.turns for s in trace),
                  "median_turns": sorted(s.turns for s in trace)[len(trace) // 2],
                  "tokens_per_session_scaled": sum(s.context(s.turns - 1) for s in trace) / len(trace),
                  "prefix_overlap": overlap(trace), "working_set_bytes": ws, "record_bytes": rb,
                  "hinted_sessions": sum(1 for s in trace if args.hinted_share > 0
                                         and s.sid % max(1, round(1 / args.hinted_share)) == 0)},
        "capacity_bytes": caps, "policies": {}}
    root = Path(tempfile.mkdtemp(prefix="dtkv-sessions-"))
    try:
        for policy in POLICIES:
            progress("sessions", f"replaying {policy}")
            out["policies"][policy] = _replay(policy, trace, args, root / policy.replace("+", "_"), caps, rb)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sessions.json").write_text(json.dumps(out, indent=2, sort_keys=True, default=str))
    out["plot"] = None if args.no_plots else _plot(out, args.out / "sessions.png")
    return out


def _plot(out: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("sessions", "matplotlib is not installed: no plot")
        return None
    pol = out["policies"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(pol)
    bottom = [0.0] * len(names)
    for tier in ("host", "ssd", "object", "miss"):
        vals = [pol[n]["hit_rate"].get(tier, 0.0) for n in names]
        a.bar(names, vals, bottom=bottom, label=tier)
        bottom = [x + y for x, y in zip(bottom, vals)]
    a.set_title("restored blocks by tier")
    a.legend()
    b.bar(names, [pol[n]["recompute_share"] for n in names])
    b.set_title("resumed turns that recompute")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def format_result(r: dict[str, Any]) -> str:
    rows = []
    for name, p in r["policies"].items():
        h = p["hit_rate"]
        rows.append([name, f"{h['host']:.2f}", f"{h['ssd']:.2f}", f"{h['object']:.2f}", f"{h['miss']:.2f}",
                     f"{p['recompute_share']:.2f}", f"{p['within_retention_recomputes']}/{p['within_retention_turns']}",
                     f"{p['restore_p50_ms']:.2f}", f"{p['restore_p99_ms']:.2f}",
                     "-" if p["host_speed_ratio_p50"] is None else f"{p['host_speed_ratio_p50']:.2f}",
                     p["s3_bytes_read"] >> 10, p["gc_bytes"] >> 10, sum(p["expired_bytes_left"].values()),
                     f"{p['ssd_allocated_bytes']['before_final_gc'] >> 10} -> "
                     f"{p['ssd_allocated_bytes']['after_final_gc'] >> 10}"])
    t = r["trace"]
    title = (f"{t['sessions']} sessions, {t['turns']} turns (median {t['median_turns']}), "
             f"{t['tokens_per_session_scaled']:.0f} tokens/session scaled, overlap {t['prefix_overlap']:.3f}, "
             f"working set {t['working_set_bytes'] >> 10} KiB; capacity KiB " +
             ", ".join(f"{k} {v >> 10}" for k, v in r["capacity_bytes"].items()))
    return table(["policy", "host", "ssd", "object", "miss", "recompute", "in-retention recomputes", "p50 ms",
                  "p99 ms", "vs host", "S3 KiB read", "GC KiB", "expired B left", "SSD KiB on disk (last GC)"],
                 rows, title=title)
