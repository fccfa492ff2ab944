"""The ``flood`` measure: one tenant floods small shared tiers; do the others keep their hits?

Tenants 0..N-2 are well-behaved: tenant ``i`` has a working set of ``W_i`` sessions of ``K``
blocks each and, every turn, revisits one of them picked with Zipf-like popularity (session
``j`` with weight ``1 / (j + 1) ** s``). A revisit is what an engine does: ``lookup`` of the
session's blocks (its hits are the leading blocks found, in any tier), ``load`` of those, and
``submit_offload`` of the rest (recomputed). The last tenant is the flooder: every turn it writes
new unique blocks (sessions never seen again) and retains all of them at the highest priority
under its own holder ``(tenant hex, "flood")``.

The tiers are real (``build_store``: host, SSD in a temp directory, objects in a local
directory or on S3), sized so that the largest well-behaved working set fills ``--fill`` of its
quota on the host tier (``--share`` of it, default 1/N), the SSD as large as the host tier and
the object tier twice that; the flooder writes ``--flood-x`` times the three capacities together
over the run.

Four runs of the same seeded workload, each on fresh tiers: quotas on (``tenant_default_share``
= ``--share``) and off (1.0, the baseline that shows the problem), each without and with the
flooder.
Before the measured turns each tenant visits every session once (a warm-up, not counted); the
flooder starts with the measured turns. The session picks are drawn before any run, so the
well-behaved tenants make the same visits in all four.

Threads: everything runs on the caller's thread; the store runs its own loop thread.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...blocks.codec import record_bytes
from ...blocks.keys import BlockKey, Namespace, chain_keys, parents_of
from ...blocks.layout import EngineLayout
from ...blocks.tenant import tenant_hex, tenant_id
from ...config import TieredKVConfig
from ...errors import ConfigError
from ...factory import build_store
from ...hints.plan import BlockRetention
from ...hints.retain import MAX_PRIORITY
from ...store import TieredStore
from ..report import progress
from ..restore_store import BUCKET, _layout, _make_bucket

#: the deployment salt the bench's tenant ids are keyed with
SALT = "dtkv-bench-tenants"
#: tokens per block (the engine layout's block size, as in ``restore_store``)
BLOCK_TOKENS = 16
#: the SSD tier's segment size (the smallest the settings allow: small tiers, many segments)
SEGMENT_BYTES = 1 << 20
#: staging for the flood runs: small slabs, enough of them for a flood turn in flight
SLAB_BYTES, SLABS = 4 << 20, 8
#: blocks per ``submit_offload`` call (one engine step's worth)
OFFLOAD_BATCH = 32
#: how often a dropped offload batch is retried after draining before it counts as dropped
OFFLOAD_TRIES = 3


@dataclass(frozen=True)
class FloodPlan:
    """The workload and the tier sizes, the same for the four runs."""

    names: tuple[str, ...]  # tenant names; the last one floods
    sessions: tuple[int, ...]  # W_i of each well-behaved tenant
    blocks: int  # K, blocks per session
    turns: int  # measured turns
    flood_blocks: int  # blocks the flooder writes per turn
    record_bytes: int
    capacities: dict[str, int]
    picks: tuple[tuple[int, ...], ...]  # per well-behaved tenant: the session it revisits each turn
    share: float  # tenant_default_share of the runs with quotas

    @property
    def flooder(self) -> str:
        return self.names[-1]

    def working_set(self, i: int) -> int:
        return self.sessions[i] * self.blocks * self.record_bytes


def plan_flood(args: argparse.Namespace, rb: int) -> FloodPlan:
    """Sizes from the arguments (module docstring); picks drawn from ``--seed``."""
    n = args.tenants
    sessions = tuple(args.sessions * w for w in parse_weights(args))
    k = args.blocks
    max_ws = max(sessions) * k * rb
    host = _round_mib(max(max_ws / (args.fill * quota_share(args)), SLAB_BYTES))
    caps = {"host": host, "ssd": max(host, 4 * SEGMENT_BYTES), "object": 2 * host}
    flood_total = args.flood_x * sum(caps.values())
    per_turn = max(k, math.ceil(flood_total / args.turns / rb / k) * k)
    rng = random.Random(args.seed)
    picks = []
    for w in sessions:
        pop = [1.0 / (j + 1) ** args.zipf for j in range(w)]
        picks.append(tuple(rng.choices(range(w), weights=pop, k=args.turns)))
    names = (*(f"tenant-{i}" for i in range(n - 1)), "flooder")
    return FloodPlan(names, sessions, k, args.turns, per_turn, rb, caps, tuple(picks), quota_share(args))


def parse_weights(args: argparse.Namespace) -> list[int]:
    """``--weights``: one positive integer per well-behaved tenant (default 1, 2, 1, 2, ...)."""
    n = args.tenants
    if not args.weights:
        return [1 + i % 2 for i in range(n - 1)]
    try:
        weights = [int(w) for w in args.weights.split(",")]
    except ValueError:
        weights = []
    if len(weights) != n - 1 or min(weights) < 1:
        raise ConfigError(f"--weights: one positive integer per well-behaved tenant ({n - 1}), got {args.weights!r}")
    return weights


def quota_share(args: argparse.Namespace) -> float:
    """``tenant_default_share`` of the runs with quotas: ``--share``, else 1/N."""
    return args.share if args.share is not None else 1.0 / args.tenants


def _round_mib(n: float) -> int:
    return math.ceil(n / (1 << 20)) << 20


def _tokens(tenant: int, session: int, blocks: int) -> np.ndarray:
    """Token ids unique to (tenant, session): its chain shares no key with any other."""
    return np.arange(blocks * BLOCK_TOKENS, dtype=np.int64) + tenant * 100_000_000 + session * 4096


class _Run:
    """One run: a fresh store over fresh tiers, the workload, the per-tenant counts."""

    def __init__(self, plan: FloodPlan, store: TieredStore, layout: EngineLayout, ns: Namespace) -> None:
        self.plan, self.store, self.layout, self.ns = plan, store, layout, ns
        self.ids = {n: tenant_id(n, deployment_salt=SALT) for n in plan.names}
        self.keys = [[chain_keys(ns, _tokens(i, s, plan.blocks)) for s in range(w)]
                     for i, w in enumerate(plan.sessions)]
        self.hits = [0] * len(plan.sessions)
        self.looked = [0] * len(plan.sessions)
        self.by_tier: list[dict[str, int]] = [{} for _ in plan.sessions]
        self.dropped = 0
        self.flood_sessions = 0

    def offload(self, keys: list[BlockKey], first: int, tenant: bytes) -> None:
        """``keys[first:]`` go to the store in engine-step batches; a dropped batch is retried
        after a drain (the engine would offload it again on a later step)."""
        parents = parents_of(keys)
        for a in range(first, len(keys), OFFLOAD_BATCH):
            b = min(a + OFFLOAD_BATCH, len(keys))
            ids = list(range(1, b - a + 1))
            for _ in range(OFFLOAD_TRIES):
                if self.store.submit_offload(self.layout, ids, keys[a:b], parents[a:b], first_index=a, tenant=tenant):
                    break
                self.store.drain(60)
            else:
                self.dropped += 1

    def visit(self, i: int, session: int, count: bool) -> None:
        """Tenant ``i`` revisits ``session``: lookup, load the hits, offload the rest."""
        keys = self.keys[i][session]
        found = self.store.lookup(keys)
        loaded = 0
        if found.num_blocks:
            res = self.store.load(self.layout, list(range(1, found.num_blocks + 1)), keys[:found.num_blocks],
                                  timeout=60)
            loaded = len(res.loaded_block_ids)
        if count:
            self.hits[i] += found.num_blocks
            self.looked[i] += len(keys)
            for name in found.tier_per_block:
                self.by_tier[i][name] = self.by_tier[i].get(name, 0) + 1
        self.offload(keys, loaded, self.ids[self.plan.names[i]])

    def flood(self) -> None:
        """The flooder's turn: new unique sessions, all retained at the highest priority."""
        tenant = self.ids[self.plan.flooder]
        holder = (tenant_hex(tenant), "flood")
        f = len(self.plan.names) - 1
        for _ in range(self.plan.flood_blocks // self.plan.blocks):
            keys = chain_keys(self.ns, _tokens(f, self.flood_sessions, self.plan.blocks))
            self.flood_sessions += 1
            self.store.retain(keys, BlockRetention(MAX_PRIORITY, None), holder=holder)
            self.offload(keys, 0, tenant)

    def play(self, flooder: bool) -> None:
        for i, w in enumerate(self.plan.sessions):  # warm-up: every session once
            for s in range(w):
                self.visit(i, s, count=False)
        self.store.drain(120)
        for t in range(self.plan.turns):
            if flooder:
                self.flood()
            for i, picks in enumerate(self.plan.picks):
                self.visit(i, picks[t], count=True)
            self.store.drain(120)

    def result(self, flooder: bool) -> list[dict[str, Any]]:
        """Per tenant: hit rate and where the hits were; per tier: bytes held, limit, retained."""
        out = []
        names = self.plan.names if flooder else self.plan.names[:-1]
        for i, name in enumerate(names):
            tid = self.ids[name]
            row: dict[str, Any] = {"name": name, "tenant": tenant_hex(tid), "flooder": name == self.plan.flooder}
            if i < len(self.plan.sessions):
                row.update(sessions=self.plan.sessions[i], working_set_bytes=self.plan.working_set(i),
                           hits=self.hits[i], blocks=self.looked[i],
                           hit_rate=self.hits[i] / self.looked[i] if self.looked[i] else None,
                           hits_by_tier=dict(self.by_tier[i]))
            else:
                row.update(flood_blocks=self.flood_sessions * self.plan.blocks,
                           flood_bytes=self.flood_sessions * self.plan.blocks * self.plan.record_bytes)
            row["tiers"] = {t.name: _tier_row(t, tid) for t in self.store.tiers}
            out.append(row)
        return out


def _tier_row(tier: Any, tid: bytes) -> dict[str, Any]:
    """What ``tid`` holds in ``tier`` against its limit, and what it has retained there."""
    usage = tier.tenant_usage()
    held = None if usage is None else usage.get(tid, (0, 0))
    h = tenant_hex(tid)
    return {"bytes": None if held is None else held[0], "blocks": None if held is None else held[1],
            "limit": tier.tenant_limit(h), "capacity": tier.usage().capacity_bytes,
            "retained": tier.retention.tenant_protected_bytes().get(h, 0)}


def _usage(tier: Any) -> dict[str, int]:
    """Record bytes and blocks ``tier`` holds, all tenants together, against its capacity."""
    u = tier.usage()
    return {"capacity": u.capacity_bytes, "bytes": u.used_bytes, "blocks": u.num_blocks}


def _config(plan: FloodPlan, root: str, quotas: bool, args: argparse.Namespace, tag: str) -> TieredKVConfig:
    caps = plan.capacities
    cfg: dict[str, Any] = {
        "metrics_port": None, "host_capacity_bytes": caps["host"],
        "ssd_dir": os.path.join(root, "ssd"), "ssd_capacity_bytes": caps["ssd"], "ssd_segment_bytes": SEGMENT_BYTES,
        "ssd_io": args.ssd_io, "object_capacity_bytes": caps["object"],
        "staging_slab_bytes": SLAB_BYTES, "staging_slabs": SLABS,
        "tenant_default_share": plan.share if quotas else 1.0,
    }
    if args.s3_endpoint:
        cfg.update(object_url=f"s3://{BUCKET}/tenants-{os.getpid()}-{tag}", s3_endpoint_url=args.s3_endpoint)
    else:
        cfg["object_url"] = f"file://{root}/objects"
    return TieredKVConfig.from_mapping(cfg)


def run_flood(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """The four runs (module docstring) and the ratio of each tenant's hit rate to its run
    without the flooder."""
    nblocks = max(args.blocks, OFFLOAD_BATCH)
    layout, ns, _ = _layout(args.shape, nblocks)
    plan = plan_flood(args, record_bytes(layout.shape))
    if args.s3_endpoint:
        import asyncio

        asyncio.run(_make_bucket(args.s3_endpoint))
    caps = plan.capacities
    progress("tenants", f"flood: {len(plan.names)} tenants, sessions {list(plan.sessions)} x {plan.blocks} blocks of "
             f"{plan.record_bytes >> 10} KiB; host {caps['host'] >> 20} MiB, ssd {caps['ssd'] >> 20} MiB, object "
             f"{caps['object'] >> 20} MiB; flooder {plan.flood_blocks} blocks per turn x {plan.turns} turns")
    runs: dict[str, dict[str, Any]] = {}
    for quotas in (True, False):
        for flooder in (False, True):
            tag = f"quotas-{'on' if quotas else 'off'}-{'flood' if flooder else 'clean'}"
            d = os.path.join(root, tag)
            os.makedirs(d)
            t0 = time.perf_counter()
            store = build_store(_config(plan, d, quotas, args, tag), ns)
            try:
                run = _Run(plan, store, layout, ns)
                run.play(flooder)
                tenants = run.result(flooder)
                dropped = run.dropped
                used = {t.name: _usage(t) for t in store.tiers}
            finally:
                store.close()
            runs[tag] = {"quotas": quotas, "flooder": flooder, "tenants": tenants, "dropped_batches": dropped,
                         "tiers": used, "seconds": time.perf_counter() - t0}
            progress("tenants", f"flood: {tag} in {runs[tag]['seconds']:.1f} s: hit rates "
                     + " ".join(f"{t['hit_rate']:.3f}" for t in tenants if not t["flooder"]))
    return {"plan": {"tenants": list(plan.names), "sessions": list(plan.sessions), "blocks": plan.blocks,
                     "turns": plan.turns, "flood_blocks_per_turn": plan.flood_blocks,
                     "record_bytes": plan.record_bytes, "capacities": caps, "share": plan.share, "zipf": args.zipf,
                     "seed": args.seed},
            "runs": runs, "ratios": _ratios(runs), "goal": _goal(runs)}


def _ratios(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """quotas on/off -> tenant -> hit rate with the flooder / without it."""
    out: dict[str, dict[str, float | None]] = {}
    for q in ("on", "off"):
        clean = {t["name"]: t["hit_rate"] for t in runs[f"quotas-{q}-clean"]["tenants"]}
        out[q] = {t["name"]: (t["hit_rate"] / clean[t["name"]] if clean[t["name"]] else None)
                  for t in runs[f"quotas-{q}-flood"]["tenants"] if not t["flooder"]}
    return out


#: every well-behaved tenant's hit rate with the flooder, against without, quotas on
GOAL_RATIO = 0.95


def _goal(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    worst = min((r for r in _ratios(runs)["on"].values() if r is not None), default=None)
    return {"target": GOAL_RATIO, "worst_ratio": worst, "met": worst is not None and worst >= GOAL_RATIO}
