"""s3_concurrency: many sessions restoring their prefixes from the object tier at once, against plain ranged GETs.

Each of up to ``max(--sessions)`` sessions owns a prefix of ``--tokens`` tokens (blocks of 16
tokens, records shaped like ``restore_store``'s). The prefixes are written through a scratch SSD
tier and flushed to the object tier (S3 at ``--s3-endpoint``/``DTKV_S3_ENDPOINT``, else a moto
server in its own process); the store that restores them has the object tier only, so every
round reads every block from S3 (nothing is promoted).

For each concurrency level S in ``--sessions``, one unreported warm-up round and ``--repeats``
rounds, each of two paths back to back (alternating which goes first, so server and cache drift
hit both):

* ``store``: S threads, each ``TieredStore.load`` of its own prefix (records verified and
  scattered into the engine layout), started together;
* ``raw``: plain aiobotocore ranged GETs of the same bytes (each session's contiguous runs in the
  data objects, in pieces of at most ``--piece-mib``, by default what the store reads with one
  GET: a staging slab), all sessions at once, with the same number of GETs in flight as the
  store's object tier (``s3_read_concurrency``), bodies read into memory.

Per level: aggregate GB/s of both paths (bytes restored by all S sessions over the wall time from
the start to the last session done; medians over rounds) and the median of the per-round ratios,
p50/p99 of the per-session restore times over all rounds (nearest rank), and the blocks the store
failed to restore (a GET that timed out: the engine would recompute them; their bytes are not
counted), and the requests the store's object tier sent per GB it restored (its backend's
counters: GETs, HEADs, LISTs, retries, hedged twins). GB/s is 10^9 bytes per second. Objects
written by the benchmark are deleted afterwards.

HDD mode (``--osd-op-delay-ms 8``, bucket on a local Ceph RGW): every OSD op waits that long
during the measured rounds (``osd_delay``), as on one spindle that seeks once per op.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ..blocks.codec import record_bytes
from ..blocks.keys import BlockKey, Namespace, chain_keys, parents_of
from ..blocks.layout import EngineLayout
from ..config import TieredKVConfig
from ..factory import build_store
from ..store import TieredStore
from ..tiers.objectstore.layout import ns_prefix
from . import osd_delay, report
from ._shapes import BLOCK_TOKENS, SHAPES, flash_layout
from .s3 import _raw_get, _start_moto

QUICK = {"sessions": "2,4", "tokens": 64, "repeats": 1}
_T = TypeVar("_T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ
    p.add_argument("--sessions", default="8,32", help="comma list of concurrency levels (sessions restoring at once)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens in each session's prefix (16 per block)")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2-7b-ish", help="layers, KV heads, head size")
    p.add_argument("--s3-endpoint", default=env.get("DTKV_S3_ENDPOINT"),
                   help="S3 server (default $DTKV_S3_ENDPOINT, else a moto server in its own process)")
    p.add_argument("--bucket", default=env.get("DTKV_S3_BUCKET", "dtkv-bench"), help="bucket (created if missing)")
    p.add_argument("--access-key", default=env.get("DTKV_S3_ACCESS_KEY", "testing"), help="S3 access key")
    p.add_argument("--secret-key", default=env.get("DTKV_S3_SECRET_KEY", "testing"), help="S3 secret key")
    p.add_argument("--region", default=env.get("DTKV_S3_REGION", "us-east-1"), help="S3 region")
    p.add_argument("--s3-read-concurrency", type=int, default=8,
                   help="ranged GETs in flight: the store's object tier (s3_read_concurrency) and the raw path")
    p.add_argument("--staging-slabs", type=int, default=8, help="the store's host staging slabs (staging_slabs)")
    p.add_argument("--piece-mib", type=int, default=0,
                   help="largest raw GET (0: as the store reads, up to one staging slab per GET)")
    p.add_argument("--first-byte-timeout-s", type=float, default=None,
                   help="the store's s3_first_byte_timeout_s (default: the setting's default)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds per level (after one warm-up round)")
    p.add_argument("--dir", default=None, help="scratch directory for the SSD tier the prefixes are written through")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: sessions 2,4 of 64 tokens, one round (overrides those flags)")
    osd_delay.add_arguments(p)


def _progress(msg: str) -> None:
    report.progress("s3_concurrency", msg)


@dataclass(frozen=True)
class Session:
    """One session's prefix: its keys, the engine blocks it restores into, and the byte ranges
    ``(object key, offset, length)`` its records occupy in the bucket (for the raw path)."""

    keys: list[BlockKey]
    block_ids: list[int]
    ranges: list[tuple[str, int, int]]


class _LoopThread:
    """An event loop on its own thread for the raw path's client (owned by this object)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dtkv-bench-raw", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float = 600.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _prefix_keys(ns: Namespace, sessions: int, tokens: int) -> list[list[BlockKey]]:
    """Distinct prefixes: session ``s`` starts with token ``s``, the rest random."""
    rng = np.random.default_rng(0)
    return [chain_keys(ns, np.concatenate([[s], rng.integers(0, 50000, tokens - 1)])) for s in range(sessions)]


def _write(cfg: dict[str, Any], ns: Namespace, layout: EngineLayout, sessions: Sequence[Session]) -> None:
    """Offload every prefix through a scratch SSD tier and flush it to the object tier."""
    store = build_store(TieredKVConfig.from_mapping(cfg), ns)
    try:
        for s in sessions:
            for c in range(0, len(s.keys), 64):  # a few slabs' worth at a time: never dropped for staging
                ids, keys = s.block_ids[c:c + 64], s.keys[c:c + 64]
                parents = parents_of(s.keys)[c:c + 64]
                for _ in range(100):
                    if store.submit_offload(layout, ids, keys, parents, first_index=c):
                        break
                    store.drain(60)  # queue or staging full: what was accepted is kept, the rest resent
                else:
                    raise RuntimeError("offloads keep being dropped")
        assert store.drain(600), "offloads did not finish"
        store.persist(600)  # seal and flush every segment to the object tier
    finally:
        store.close()


def _ranges(store: TieredStore, key_prefix: str, keys: Sequence[BlockKey], piece: int) -> list[tuple[str, int, int]]:
    """The bucket ranges of ``keys``' records: contiguous runs, cut into pieces of ``piece`` bytes."""
    obj = store.tiers[-1]
    runs: list[list[Any]] = []
    for k in keys:
        loc = obj.location(k)
        assert loc is not None, "a block the store found is not indexed"
        name, e = loc
        if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == e.offset:
            runs[-1][2] += e.length
        else:
            runs.append([name, e.offset, e.length])
    return [(key_prefix + name, off + o, min(piece, n - o)) for name, off, n in runs for o in range(0, n, piece)]


def _store_round(store: TieredStore, layout: EngineLayout,
                 sessions: Sequence[Session]) -> tuple[float, list[float], int]:
    """Every session's load on its own thread, started together: (wall s, per-session s, blocks
    that failed to restore)."""
    start = threading.Barrier(len(sessions) + 1)
    times = [0.0] * len(sessions)
    failed = [0] * len(sessions)

    def one(i: int, s: Session) -> None:
        start.wait()
        t0 = time.perf_counter()
        res = store.load(layout, s.block_ids, s.keys, timeout=600)
        times[i] = time.perf_counter() - t0
        failed[i] = len(res.failed_block_ids)

    threads = [threading.Thread(target=one, args=(i, s), name=f"session-{i}") for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, times, sum(failed)


async def _raw_round(client: Any, bucket: str, sessions: Sequence[Session], conc: int) -> tuple[float, list[float]]:
    """Every session's ranges as plain ranged GETs, ``conc`` in flight in all: (wall s, per-session s)."""
    sem = asyncio.Semaphore(conc)
    t0 = time.perf_counter()

    async def get(key: str, off: int, n: int) -> int:
        async with sem:
            return await _raw_get(client, bucket, key, off, n)

    async def session(s: Session) -> float:
        await asyncio.gather(*(get(*r) for r in s.ranges))
        return time.perf_counter() - t0

    times = await asyncio.gather(*(session(s) for s in sessions))
    return time.perf_counter() - t0, list(times)


def _level(n: int, store: TieredStore, layout: EngineLayout, sessions: Sequence[Session], raw: _LoopThread,
           client: Any, args: argparse.Namespace, nbytes: int, record: int) -> dict[str, Any]:
    ours = sessions[:n]
    total = nbytes * n
    gbps: dict[str, list[float]] = {"store": [], "raw": []}
    times: dict[str, list[float]] = {"store": [], "raw": []}
    failed = requests = restored = 0
    stats = store.tiers[-1].backend.stats  # the store's own connection (the raw path has its own)
    steps = report.Steps("s3_concurrency", args.repeats + 1)
    for r in range(args.repeats + 1):  # round 0 warms connections and server pools: not reported
        for path in (("store", "raw") if r % 2 == 0 else ("raw", "store")):
            lost = 0
            if path == "store":
                before = osd_delay.stats_snapshot(stats)
                wall, each, lost = _store_round(store, layout, ours)
                if r:
                    requests += osd_delay.object_requests(before, osd_delay.stats_snapshot(stats))
                    restored += total - lost * record
            else:
                wall, each = raw.call(_raw_round(client, args.bucket, ours, args.s3_read_concurrency))
            if r:
                gbps[path].append((total - lost * record) / wall / 1e9)
                times[path].extend(each)
                failed += lost
        steps.step(f"{n} sessions: warm-up" if r == 0 else
                   f"{n} sessions, round {r}: store {gbps['store'][-1]:.3f} GB/s, raw {gbps['raw'][-1]:.3f} GB/s")
    return {
        "sessions": n,
        "bytes": total,
        "gbps": statistics.median(gbps["store"]),
        "raw_gbps": statistics.median(gbps["raw"]),
        # each round's two paths ran back to back: a noisy neighbour slows both alike
        "ratio": statistics.median(s / r for s, r in zip(gbps["store"], gbps["raw"], strict=True)),
        "failed_blocks": failed,
        "requests_per_gb": osd_delay.per_gb(requests, restored),
        "p50_ms": report.percentile(times["store"], 0.5) * 1e3,
        "p99_ms": report.percentile(times["store"], 0.99) * 1e3,
        "raw_p50_ms": report.percentile(times["raw"], 0.5) * 1e3,
        "raw_p99_ms": report.percentile(times["raw"], 0.99) * 1e3,
        "rounds_gbps": {p: [round(x, 4) for x in xs] for p, xs in gbps.items()},
    }


async def _open_raw(args: argparse.Namespace, endpoint: str) -> Any:
    from ..tiers.objectstore import S3Backend

    b = S3Backend(args.bucket, "", endpoint_url=endpoint, region=args.region, access_key=args.access_key,
                  secret_key=args.secret_key, create_bucket=True, max_concurrency=args.s3_read_concurrency,
                  read_concurrency=args.s3_read_concurrency)
    await b.open()
    return b


async def _delete_prefix(backend: Any, prefix: str) -> None:
    for o in await backend.list(prefix):
        await backend.delete(o.name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    levels = sorted({int(x) for x in str(args.sessions).split(",") if x.strip()})
    if not levels or levels[0] < 1 or args.tokens < BLOCK_TOKENS:
        raise ValueError(f"--sessions needs positive counts and --tokens at least {BLOCK_TOKENS}")
    torch.set_num_threads(1)
    blocks = args.tokens // BLOCK_TOKENS
    layout, ns = flash_layout(args.shape, levels[-1] * blocks, name=f"bench-{args.shape}")
    nbytes = blocks * record_bytes(layout.shape)
    ceph = osd_delay.hdd_mode("s3_concurrency", args.s3_endpoint, args.osd_op_delay_ms, args.ceph_dir)
    moto = None
    endpoint = args.s3_endpoint
    if not endpoint:
        moto, endpoint = _start_moto()
    raw = _LoopThread()
    run_prefix = f"s3-concurrency-{uuid.uuid4().hex[:8]}"
    root = tempfile.mkdtemp(prefix="dtkv-s3conc-", dir=args.dir)
    backend = store = None
    piece, first_byte_s = 0, 0.0  # set once the store is open
    delay: dict[str, Any] | None = None
    try:
        backend = raw.call(_open_raw(args, endpoint))  # creates the bucket; the raw path's client
        cfg: dict[str, Any] = {
            "metrics_port": None, "host_capacity_bytes": 0, "object_url": f"s3://{args.bucket}/{run_prefix}",
            "s3_endpoint_url": endpoint, "s3_region": args.region, "s3_access_key": args.access_key,
            "s3_secret_key": args.secret_key, "s3_read_concurrency": args.s3_read_concurrency,
            "staging_slabs": args.staging_slabs,
        }
        if args.first_byte_timeout_s is not None:
            cfg["s3_first_byte_timeout_s"] = args.first_byte_timeout_s
        keys = _prefix_keys(ns, levels[-1], args.tokens)
        sessions = [Session(k, list(range(1 + s * blocks, 1 + (s + 1) * blocks)), []) for s, k in enumerate(keys)]
        _progress(f"{endpoint}: writing {len(sessions)} prefixes of {blocks} blocks "
                  f"({len(sessions) * nbytes / 2**20:.0f} MiB) through a scratch SSD tier")
        ssd_bytes = 2 * len(sessions) * nbytes + (256 << 20)
        _write({**cfg, "ssd_dir": os.path.join(root, "ssd"), "ssd_capacity_bytes": ssd_bytes}, ns, layout, sessions)
        store = build_store(TieredKVConfig.from_mapping(cfg), ns)  # the object tier only: every load reads S3
        obj = store.tiers[-1]
        store._call(obj.wait_ready(600), timeout=610)
        key_prefix = f"{run_prefix}/{ns_prefix(ns.digest)}"
        piece = args.piece_mib << 20 or min(store.staging.slab_bytes, obj.read_piece_bytes or store.staging.slab_bytes)
        sessions = [Session(s.keys, s.block_ids, _ranges(store, key_prefix, s.keys, piece)) for s in sessions]
        first_byte_s = TieredKVConfig.from_mapping(cfg).s3_first_byte_timeout_s
        short = [i for i, s in enumerate(sessions) if store.lookup(s.keys).num_blocks != blocks]
        if short:
            raise RuntimeError(f"sessions {short} are not wholly restorable from the object tier")
        with osd_delay.measured(ceph, args.osd_op_delay_ms) as delay:
            rows = [_level(n, store, layout, sessions, raw, backend._client, args, nbytes,
                           record_bytes(layout.shape)) for n in levels]
    finally:
        if store is not None:
            store.close()
        if backend is not None:
            raw.call(_delete_prefix(backend, run_prefix + "/"))
            raw.call(backend.close())
        raw.close()
        shutil.rmtree(root, ignore_errors=True)
        if moto is not None:
            moto.terminate()
            moto.wait(10)
    return {
        "endpoint": endpoint,
        "server": "moto (local process)" if moto is not None else "given endpoint",
        "shape": args.shape,
        "tokens": args.tokens,
        "blocks_per_session": blocks,
        "bytes_per_session": nbytes,
        "s3_read_concurrency": args.s3_read_concurrency,
        "staging_slabs": args.staging_slabs,
        "s3_first_byte_timeout_s": first_byte_s,
        "raw_piece_bytes": piece,
        "repeats": args.repeats,
        "osd_op_delay": delay,
        "levels": rows,
    }


def format_result(res: dict[str, Any]) -> str:
    """One row per concurrency level: the store's restores against plain ranged GETs of the same bytes."""
    rows = [[r["sessions"], r["bytes"] / 2**20, r["gbps"], r["raw_gbps"], r["ratio"], r["p50_ms"], r["p99_ms"],
             r["raw_p50_ms"], r["raw_p99_ms"], r["failed_blocks"]] for r in res["levels"]]
    title = (f"s3_concurrency: {res['endpoint']} ({res['server']}), prefixes of {res['tokens']} tokens "
             f"({res['bytes_per_session'] / 2**20:.1f} MiB, {res['shape']}), s3_read_concurrency "
             f"{res['s3_read_concurrency']}, {res['staging_slabs']} staging slabs, first-byte timeout "
             f"{res['s3_first_byte_timeout_s']} s; medians of {res['repeats']} rounds (ratio: median of per-round "
             f"store/raw)")
    out = report.table(["sessions", "MiB", "GB/s", "raw GB/s", "store/raw", "p50 ms", "p99 ms", "raw p50 ms",
                        "raw p99 ms", "failed blocks"], rows, title=title,
                       fmts=["", ".0f", ".3f", ".3f", ".2f", ".1f", ".1f", ".1f", ".1f", ""])
    lines = [osd_delay.summary_line(f"{r['sessions']} sessions (p50)", r.get("requests_per_gb"), r["p50_ms"] / 1e3,
                                    res["bytes_per_session"], res.get("osd_op_delay")) for r in res["levels"]]
    return "\n".join([out, "", *lines])
