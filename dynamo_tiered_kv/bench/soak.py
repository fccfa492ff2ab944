"""soak: many agent-like sessions against one TieredStore for minutes; does anything grow?

Sessions (threads) run conversations whose prompts grow by a few blocks per turn, pause as an agent
waiting on a tool would, often resume an older conversation, and share a few system prompts. Each
turn looks its prefix up, restores it (``load``), checks every restored byte against the block's
expected content, "recomputes" the rest and offloads it. Host, SSD and object capacities are small,
so every tier evicts all the time; TTLs expire blocks, the object tier re-lists its manifests, and
``gc_bucket`` runs on the objects (local directory, or S3 with ``--s3-endpoint``). With hints on
(the default; ``--no-hints``), every turn carries a KV hints envelope, one in ten hostile, applied
as the engine adapters apply them (``soak_hints``).

Every ``--interval-s`` (60 s) one sample: RSS, open files (/proc/self/fd), threads, each tier's
used bytes and block count, and the store's bookkeeping sizes (``OffloadWriter.bookkeeping``). At the
end, per series over the samples after warm-up (the first third): the least-squares drift across
that window relative to its mean; a series is flat when the drift is within 5% (or under one unit:
counts). ``wrong_bytes`` must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..blocks.keys import BlockKey, Namespace, chain_keys, parents_of
from ..blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from ..config import TieredKVConfig
from ..factory import build_store
from ..store import TieredStore
from .report import progress, table
from .soak_hints import HintedTurns, conversation_scope

BS, LAYERS, HEADS, HEAD = 16, 4, 2, 64  # 32 KiB blocks (bfloat16)
MiB = 1 << 20
FLAT = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="run time")
    p.add_argument("--seconds", type=float, default=None, help="run time in seconds (overrides --minutes)")
    p.add_argument("--interval-s", type=float, default=None,
                   help="sampling interval (default 60 s, or a sixth of the run if shorter)")
    p.add_argument("--sessions", type=int, default=6, help="concurrent agent sessions (threads)")
    p.add_argument("--dir", default=None, help="directory for the SSD tier and local objects (default: temp)")
    p.add_argument("--s3-endpoint", default=None, help="object tier on this S3 server instead of a local directory")
    p.add_argument("--host-mib", type=int, default=8, help="host tier capacity")
    p.add_argument("--ssd-mib", type=int, default=32, help="SSD tier capacity (1 MiB segments)")
    p.add_argument("--object-mib", type=int, default=96, help="object tier capacity")
    p.add_argument("--gc-every-s", type=float, default=6.0, help="object GC interval (TTL 4x, grace 1x that)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hints", action=argparse.BooleanOptionalAction, default=True,
                   help="every turn carries kv.retain (some prefetch, one in ten hostile); --no-hints: none")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Residency:
    """Counts the blocks each medium reports removed (evictions, TTL expiry, deletes)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def stored(self, medium: str, keys: Sequence[BlockKey]) -> None:
        pass

    def removed(self, medium: str, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self.counts[medium] = self.counts.get(medium, 0) + len(keys)


class _Totals:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.turns = self.looked_up = self.restored = self.failed = self.offloaded = self.dropped = 0
        self.restored_bytes = self.wrong_bytes = 0
        self.by_tier: dict[str, int] = {}
        self.errors: list[str] = []


def _expected(key: BlockKey, layer: int, nbytes: int) -> np.ndarray:
    """A block's content is a function of its key and layer: a restore is checked byte for byte."""
    d = np.frombuffer(hashlib.blake2b(key + bytes([layer]), digest_size=64).digest(), np.uint8)
    return np.tile(d, nbytes // 64)


class _Session:
    """One engine's worth of KV (its own blocks) running agent turns until ``stop``."""

    def __init__(self, sid: int, store: TieredStore, ns: Namespace, totals: _Totals, stop: threading.Event,
                 seed: int, max_blocks: int = 48, hinted: HintedTurns | None = None) -> None:
        self.store, self.ns, self.totals, self.stop = store, ns, totals, stop
        self.hinted = hinted
        self.rng = random.Random(seed * 1000 + sid)
        self.max_blocks = max_blocks
        kind = EngineLayoutKind.VLLM_CPU
        self.tensors = allocate_engine_kv(kind, num_layers=LAYERS, num_blocks=max_blocks, block_size=BS,
                                          num_kv_heads=HEADS, head_size=HEAD)
        self.layout = EngineLayout(kind, self.tensors, BS, HEADS, HEAD)
        self.block_nbytes = self.tensors[0][0].numel() * self.tensors[0].element_size()
        self.past: deque[np.ndarray] = deque(maxlen=64)  # conversations to resume (bounded)
        self.sid = sid

    def _new_conversation(self) -> np.ndarray:
        system = self.rng.randrange(4)  # a few shared system prompts: cross-session hits
        head = (np.arange(2 * BS) * 7 + system * 1000) % 50000
        tail = np.array([self.rng.randrange(50000) for _ in range(BS)])
        return np.concatenate([head, tail])

    def run(self) -> None:
        try:
            conv = self._new_conversation()
            while not self.stop.is_set():
                conv = self._turn(conv)
                self.stop.wait(self.rng.uniform(0.0, 0.2))  # the agent's tool call
        except Exception as e:  # reported, not raised: the other sessions go on
            with self.totals.lock:
                self.totals.errors.append(f"session {self.sid}: {type(e).__name__}: {e}")

    def _turn(self, conv: np.ndarray) -> np.ndarray:
        r = self.rng.random()
        if r < 0.3 and self.past:  # resume an older conversation (its blocks are in lower tiers by now)
            self.past.append(conv)
            conv = self.past[self.rng.randrange(len(self.past))]
        grow = np.array([self.rng.randrange(50000) for _ in range(BS * self.rng.randint(1, 4))])
        conv = np.concatenate([conv, grow])
        if len(conv) // BS > self.max_blocks:  # conversation over: a new one
            self.past.append(conv[:self.max_blocks * BS])
            conv = self._new_conversation()
        n = len(conv) // BS
        keys = chain_keys(self.ns, conv[:n * BS])
        ids = list(range(n))
        if self.hinted is not None:
            others = [conversation_scope(c, BS) for c in list(self.past)[-4:]]
            hit, _ = self.hinted.turn(self.sid, self.rng, conv, keys, others)
        else:
            hit = self.store.lookup(keys).num_blocks
        loaded: list[int] = []
        wrong = restored_bytes = 0
        tiers: dict[str, int] = {}
        if hit:
            res = self.store.load(self.layout, ids[:hit], keys[:hit], timeout=10.0)
            loaded = res.loaded_block_ids
            for b, tier in zip(loaded, res.tier_per_block):
                tiers[tier] = tiers.get(tier, 0) + 1
                for layer, t in enumerate(self.tensors):
                    got = t[b].contiguous().view(torch.uint8).numpy().reshape(-1)
                    wrong += int(np.count_nonzero(got != _expected(keys[b], layer, got.nbytes)))
                    restored_bytes += got.nbytes
        start = len(loaded)
        for b in range(start, n):  # "recompute" the rest
            for layer, t in enumerate(self.tensors):
                t[b].view(torch.uint8).view(-1).copy_(torch.from_numpy(_expected(keys[b], layer, self.block_nbytes)))
        ok = True
        if start < n:
            ok = self.store.submit_offload(self.layout, ids[start:n], keys[start:n], parents_of(keys)[start:n],
                                           first_index=start)
        with self.totals.lock:
            tt = self.totals
            tt.turns += 1
            tt.looked_up += hit
            tt.restored += len(loaded)
            tt.failed += hit - len(loaded)
            tt.restored_bytes += restored_bytes
            tt.wrong_bytes += wrong
            tt.offloaded += n - start
            tt.dropped += 0 if ok else n - start
            for k, v in tiers.items():
                tt.by_tier[k] = tt.by_tier.get(k, 0) + v
        return conv


class _Gc:
    """``gc_bucket`` on the object tier's storage every ``every_s`` (own backend, own event loop)."""

    def __init__(self, url: str, endpoint: str | None, every_s: float, stop: threading.Event) -> None:
        self.url, self.endpoint, self.every_s, self.stop = url, endpoint, every_s, stop
        self.runs = self.deleted = self.errors = 0

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                rep = asyncio.run(self._once())
                self.runs += 1
                self.deleted += rep.deleted_data
                self.errors += rep.errors
            except Exception as e:
                self.errors += 1
                progress("soak", f"gc failed: {e}")

    async def _once(self):
        from ..tiers.objectstore import backend_from_url
        from ..tiers.objectstore.gc import gc_bucket

        backend = backend_from_url(self.url, endpoint_url=self.endpoint)
        await backend.open()
        try:
            return await gc_bucket(backend, ttl_s=4 * self.every_s, grace_s=self.every_s)
        finally:
            await backend.close()


def _sample(store: TieredStore, t0: float) -> dict[str, float]:
    s: dict[str, float] = {"t_s": time.monotonic() - t0, "rss_mib": _rss_bytes() / MiB,
                           "open_files": len(os.listdir("/proc/self/fd")), "threads": _os_threads()}
    for tier in store.tiers:
        u = tier.usage()
        s[f"{tier.name}_used_mib"] = u.used_bytes / MiB
        s[f"{tier.name}_blocks"] = u.num_blocks
        index_nbytes = getattr(tier, "index_nbytes", None)
        if index_nbytes is not None:
            s[f"{tier.name}_index_kib"] = index_nbytes() / 1024
    s.update({k: float(v) for k, v in store.writer.bookkeeping().items()})
    flusher = getattr(store, "flusher", None)
    if flusher is not None:
        s["flush_queue"] = flusher.stats.queue_length
    return s


def drift(values: Sequence[float]) -> float:
    """Change of the least-squares line across the samples (last minus first fitted value)."""
    n = len(values)
    if n < 2:
        return 0.0
    x = np.arange(n, dtype=float)
    slope = np.polyfit(x, np.asarray(values, dtype=float), 1)[0]
    return float(slope * (n - 1))


def flatness(samples: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per series, over the samples after warm-up (the first third): mean, min, max, drift, flat."""
    after = samples[len(samples) // 3:]
    out: dict[str, dict[str, Any]] = {}
    for name in samples[0]:
        if name == "t_s":
            continue
        vals = [s.get(name, 0.0) for s in after]
        mean = float(np.mean(vals)) if vals else 0.0
        d = drift(vals)
        out[name] = {"mean": mean, "min": min(vals, default=0.0), "max": max(vals, default=0.0), "drift": d,
                     "drift_pct": 100 * d / mean if mean else 0.0,
                     "flat": abs(d) <= FLAT * abs(mean) or abs(d) < 1.0}
    return out


def _config(args: argparse.Namespace, root: str) -> tuple[TieredKVConfig, str]:
    if args.s3_endpoint:
        from .restore_store import BUCKET, _make_bucket

        asyncio.run(_make_bucket(args.s3_endpoint))
        url = f"s3://{BUCKET}/soak-{os.getpid()}"
    else:
        url = f"file://{root}/objects"
    cfg = TieredKVConfig(
        host_capacity_bytes=args.host_mib * MiB, host_ttl_s=120.0,
        ssd_dir=os.path.join(root, "ssd"), ssd_capacity_bytes=args.ssd_mib * MiB, ssd_segment_bytes=MiB,
        ssd_seal_idle_s=1.0, ssd_ttl_s=300.0, object_url=url, object_capacity_bytes=args.object_mib * MiB,
        object_refresh_s=5.0, s3_endpoint_url=args.s3_endpoint, staging_slab_bytes=2 * MiB, staging_slabs=16,
        max_pending_offloads=256, metrics_port=None,
    )
    return cfg, url


def run(args: argparse.Namespace) -> dict:
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    interval = args.interval_s or min(60.0, max(0.2, duration / 6))
    root = tempfile.mkdtemp(prefix="dtkv-soak-", dir=args.dir)
    cfg, url = _config(args, root)
    ns = Namespace("soak", "bfloat16", EngineLayoutKind.VLLM_CPU.name, BS, LAYERS, HEADS, HEAD)
    store = build_store(cfg, ns, rank=0)
    residency = _Residency()
    store.set_residency(residency)
    totals, stop = _Totals(), threading.Event()
    hinted = HintedTurns(store, BS) if args.hints else None
    sessions = [_Session(i, store, ns, totals, stop, args.seed, hinted=hinted) for i in range(args.sessions)]
    gc = _Gc(url, args.s3_endpoint, args.gc_every_s, stop)
    threads = [threading.Thread(target=s.run, name=f"soak-{s.sid}", daemon=True) for s in sessions]
    threads.append(threading.Thread(target=gc.run, name="soak-gc", daemon=True))
    progress("soak", f"{args.sessions} sessions for {duration:.0f}s, sample every {interval:.0f}s; "
             f"host {args.host_mib} MiB, SSD {args.ssd_mib} MiB, objects {args.object_mib} MiB at {url}")
    t0 = time.monotonic()
    samples: list[dict[str, float]] = []
    try:
        for t in threads:
            t.start()
        while True:
            left = t0 + duration - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(interval, left))
            s = _sample(store, t0)
            if hinted is not None:
                s.update(hinted.sample())
            s["turns"] = totals.turns
            samples.append(s)
            progress("soak", f"{s['t_s']:.0f}s: rss {s['rss_mib']:.0f} MiB, fds {s['open_files']:.0f}, "
                     f"threads {s['threads']:.0f}, turns {totals.turns}, restored {totals.restored}, "
                     f"wrong bytes {totals.wrong_bytes}")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    series = flatness([{k: v for k, v in s.items() if k != "turns"} for s in samples]) if samples else {}
    return {
        "duration_s": duration, "interval_s": interval, "sessions": args.sessions, "object_url": url.split("://")[0],
        "capacities_mib": {"host": args.host_mib, "ssd": args.ssd_mib, "object": args.object_mib},
        "turns": totals.turns, "blocks_looked_up": totals.looked_up, "blocks_restored": totals.restored,
        "blocks_failed": totals.failed, "restored_by_tier": totals.by_tier, "blocks_offloaded": totals.offloaded,
        "blocks_dropped": totals.dropped, "restored_bytes": totals.restored_bytes, "wrong_bytes": totals.wrong_bytes,
        "removed_by_medium": dict(residency.counts), "gc_runs": gc.runs, "gc_deleted_objects": gc.deleted,
        "gc_errors": gc.errors, "session_errors": totals.errors, "samples": samples, "series": series,
        "hinted_turns": hinted.turns if hinted else 0, "hostile_turns": hinted.hostile if hinted else 0,
        "sessions_ended": hinted.ended if hinted else 0,
        "all_flat": all(v["flat"] for v in series.values()) if series else False,
    }


def format_result(res: dict) -> str:
    samples = res["samples"]
    cols = [c for c in (samples[0] if samples else {}) if c != "turns"]
    out = [table(cols, [[s.get(c, 0.0) for c in cols] for s in samples], fmts=[".0f"] + [".1f"] * (len(cols) - 1),
                 title=f"soak: {res['sessions']} sessions, {res['duration_s']:.0f}s, one sample every "
                       f"{res['interval_s']:.0f}s")]
    rows = [[k, v["mean"], v["min"], v["max"], v["drift_pct"], "yes" if v["flat"] else "NO"]
            for k, v in res["series"].items()]
    out.append(table(["series", "mean", "min", "max", "drift %", "flat"], rows,
                     fmts=["", ".1f", ".1f", ".1f", ".1f", ""],
                     title="after warm-up (first third): least-squares drift across the window, flat within 5%"))
    out.append(f"turns {res['turns']}, blocks restored {res['blocks_restored']} "
               f"({res['restored_bytes'] / MiB:.0f} MiB, by tier {res['restored_by_tier']}), failed "
               f"{res['blocks_failed']}, offloaded {res['blocks_offloaded']} (dropped {res['blocks_dropped']}), "
               f"removed by medium {res['removed_by_medium']}, gc runs {res['gc_runs']} "
               f"(deleted {res['gc_deleted_objects']} objects), wrong bytes {res['wrong_bytes']}, "
               f"all flat: {res['all_flat']}")
    if res["session_errors"]:
        out.append("session errors: " + "; ".join(res["session_errors"][:5]))
    return "\n".join(out)
