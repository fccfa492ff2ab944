"""faults: restores from an object tier whose bucket stalls, delays or resets, against their bounds.

A prefix of each ``--tokens`` length (the ``restore_store`` model shape) is stored into an object
tier through a fault-injecting TCP proxy in front of the S3 server (a moto server in its own
process by default, ``--s3-url`` for Ceph RGW or another gateway), with the store's default
settings (``--recompute-tokens-per-s`` adds the recompute budget). Then, per proxy mode, the
prefix is restored through ``TieredStore.load`` (no engine: the engine-shaped tensors of the
bench) while the proxy

* ``pass``: forwards everything (the reference);
* ``delay``: holds every response ``--delay-s`` (10 s) before each of its chunks (a gateway
  whose every request waits behind an overloaded HDD pool);
* ``stall``: accepts every request and answers none;
* ``reset_body``: forwards a response's headers and its first 16 KiB of body, then resets the
  connection (every connection: no retry ever completes);
* ``stall_body``: the same cut, but the reset never arrives: the connection stays open and
  silent (a lost RST, a middlebox that dropped the flow).

Per mode and prefix: the time until ``load`` returned (served or given up), blocks restored and
recomputed, wrong bytes among the restored blocks (each compared with the bytes stored: must be
0), blocks lost (after the fault, with the proxy passing again, a restore must serve every block:
must be 0), the bound the restore had to meet (``stalls.py``: ``STALL_WAITS`` first-byte bounds for
``delay`` and ``stall``, as many body idle timeouts for ``stall_body``; the retry policy's
backoffs for ``reset_body``; the recompute budget when one is set and sooner), the recompute
time that budget assumed, and the backend's
hedges, retries and the restores the store counted abandoned. Between modes the bench waits for
the backend's circuit breaker to close again, so every mode starts from a healthy backend.

Threads: the store runs its own loop; the proxy runs on a loop of its own thread (``_ProxyThread``);
everything else runs on the caller's thread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import torch

from ..blocks.codec import record_bytes
from ..blocks.keys import chain_keys, parents_of
from ..blocks.layout import EngineLayout
from ..config import TieredKVConfig
from ..factory import build_store
from ..store import TieredStore
from ..tiers.objectstore.s3 import S3Backend
from ..tiers.objectstore.stalls import STALL_WAITS
from ._faultproxy import FaultProxy
from ._shapes import BLOCK_TOKENS, SHAPES, flash_layout
from .report import progress, table

MODES = ("pass", "delay", "stall", "reset_body", "stall_body")
LOAD_TIMEOUT_S = 30.0  # the store's default load_timeout_s: what an unbounded restore would wait
BREAKER_WAIT_S = 30.0  # longest wait for the backend's circuit breaker to close between modes
_T = TypeVar("_T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="2048,8192", help="comma list of prefix lengths restored (tokens)")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2-7b-ish", help="layers, KV heads, head size")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of proxy modes: {', '.join(MODES)}")
    p.add_argument("--delay-s", type=float, default=10.0, help="delay mode: seconds before each response chunk")
    p.add_argument("--s3-url", default=None,
                   help="S3 endpoint behind the proxy, e.g. Ceph RGW (default: a moto server this bench starts)")
    p.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", "testing"))
    p.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"))
    p.add_argument("--bucket", default=os.environ.get("DTKV_S3_BUCKET", "dtkv-bench"))
    p.add_argument("--recompute-tokens-per-s", type=float, default=None,
                   help="the store's recompute_tokens_per_s (default: unset, the store's default)")
    p.add_argument("--repeats", type=int, default=1, help="restores per mode and prefix")


def _progress(msg: str) -> None:
    progress("faults", msg)


class _ProxyThread:
    """A ``FaultProxy`` on an event loop of its own daemon thread; ``call`` runs a coroutine there
    and waits for it. Every proxy attribute is set through ``call`` (the proxy's loop owns it)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dtkv-faultproxy", daemon=True)
        self._thread.start()
        self.proxy = self.call(FaultProxy(upstream_host, upstream_port).start())
        self.endpoint = self.proxy.endpoint

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float = 30.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def set_mode(self, mode: str, delay_s: float) -> None:
        """New connections get ``mode``; every open one is cut (pooled keep-alive connections too),
        so the next request meets the fault."""

        async def switch() -> None:
            self.proxy.delay_s = delay_s
            self.proxy.set_mode(mode)
            self.proxy.sever()

        self.call(switch())

    def close(self) -> None:
        try:
            self.call(self.proxy.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def _block_bytes(layout: EngineLayout, block: int) -> np.ndarray:
    """Every layer's K and V of engine block ``block``, as bytes (a copy)."""
    return np.concatenate([t[:, block].contiguous().view(torch.uint8).numpy().ravel() for t in layout.tensors])


def _wrong_bytes(layout: EngineLayout, restored: list[int], stored: dict[int, np.ndarray]) -> int:
    return int(sum(np.count_nonzero(_block_bytes(layout, b) != stored[b]) for b in restored))


def _clear(layout: EngineLayout, blocks: list[int]) -> None:
    """Zero the blocks a restore writes, so bytes left by an earlier restore cannot pass as restored."""
    for t in layout.tensors:
        t[:, blocks] = 0


def _backend(store: TieredStore) -> S3Backend:
    b = store.tiers[-1].root_backend  # type: ignore[attr-defined]
    assert isinstance(b, S3Backend)
    return b


def _settle(store: TieredStore, backend: S3Backend) -> None:
    """Wait until the backend's circuit breaker lets calls through again (and close it with a
    probe), so the next mode starts from a healthy backend."""
    deadline = time.monotonic() + BREAKER_WAIT_S
    while backend.breaker.state == "open" and time.monotonic() < deadline:
        time.sleep(0.2)
    if backend.breaker.state != "closed":
        store._call(backend.list("", start_after="~"), 30)  # a cheap call: the half-open probe


def _bound_s(mode: str, backend: S3Backend, budget_s: float | None) -> float | None:
    """How long the restore may take before it has given up, by the product's rules."""
    r = backend.retry
    if mode in ("delay", "stall"):  # silent attempts, one backoff between them
        bound = STALL_WAITS * backend.first_byte_timeout_s + r.base_delay_s
    elif mode == "stall_body":
        bound = STALL_WAITS * backend.body_idle_timeout_s + r.base_delay_s
    elif mode == "reset_body":  # every attempt fails when its reset arrives: the backoffs at their caps
        bound = sum(min(r.max_delay_s, r.base_delay_s * 2 ** n) for n in range(r.max_attempts - 1))
    else:
        return None
    return bound if budget_s is None else min(bound, budget_s)


def _restore_prefix(store: TieredStore, proxy: _ProxyThread, layout: EngineLayout, keys: list, tokens: int,
                    args: argparse.Namespace, rate: float | None) -> list[dict]:
    n = len(keys)
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    stored = {d: _block_bytes(layout, s) for s, d in zip(src, dst)}
    backend = _backend(store)
    budget_s = None if rate is None else max(0.2, tokens / rate)
    rows = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
        for rep in range(args.repeats):
            _settle(store, backend)
            abandoned = {r: store.metrics.value("restores_abandoned_total", reason=r)
                         for r in ("estimate", "budget", "deadline")}
            before = (backend.stats.hedges_sent, backend.stats.hedges_won, backend.stats.retries)
            _clear(layout, dst)
            proxy.set_mode(mode, args.delay_s)
            t0 = time.perf_counter()
            res = store.load(layout, dst, keys, LOAD_TIMEOUT_S)
            took = time.perf_counter() - t0
            proxy.set_mode("pass", args.delay_s)
            wrong = _wrong_bytes(layout, res.loaded_block_ids, stored)
            _settle(store, backend)  # then nothing of the bucket may be lost: every block restores
            _clear(layout, dst)
            after = store.load(layout, dst, keys, LOAD_TIMEOUT_S)
            wrong += _wrong_bytes(layout, after.loaded_block_ids, stored)
            row = {"tokens": tokens, "mode": mode, "repeat": rep, "seconds": took, "blocks": n,
                   "restored": len(res.loaded_block_ids), "recomputed": len(res.failed_block_ids),
                   "wrong_bytes": wrong, "lost": len(after.failed_block_ids),
                   "bound_s": _bound_s(mode, backend, budget_s), "recompute_budget_s": budget_s,
                   "hedges_sent": backend.stats.hedges_sent - before[0],
                   "hedges_won": backend.stats.hedges_won - before[1], "retries": backend.stats.retries - before[2],
                   "abandoned": {r: store.metrics.value("restores_abandoned_total", reason=r) - v
                                 for r, v in abandoned.items()}}
            rows.append(row)
            _progress(f"{tokens} tokens, {mode}: {took:.2f} s, {row['restored']}/{n} restored, "
                      f"{wrong} wrong bytes, {row['lost']} lost")
    return rows


def _bench(args: argparse.Namespace, endpoint: str) -> list[dict]:
    sizes = [int(t) for t in args.tokens.split(",") if t.strip()]
    if not sizes or min(sizes) < BLOCK_TOKENS:
        raise ValueError(f"--tokens: prefix lengths of at least {BLOCK_TOKENS} tokens")
    host, port = endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = _ProxyThread(host, int(port))
    store = None
    try:
        layout, ns = flash_layout(args.shape, 2 * max(sizes) // BLOCK_TOKENS, name=f"bench-faults-{args.shape}",
                                  fill=False)
        cfg: dict[str, Any] = {
            "metrics_port": None, "host_capacity_bytes": 0, "object_url": f"s3://{args.bucket}/faults-{os.getpid()}",
            "s3_endpoint_url": proxy.endpoint, "s3_access_key": args.access_key, "s3_secret_key": args.secret_key,
            "object_refresh_s": None, "expire_interval_s": 0,  # no background pass meets the faults
            "recompute_tokens_per_s": args.recompute_tokens_per_s}
        store = build_store(TieredKVConfig.from_mapping(cfg), ns)
        tier = store.tiers[-1]
        assert store._call(tier.wait_ready(60), 70), "the object tier did not index the bucket"  # type: ignore[attr-defined]
        rows: list[dict] = []
        for i, tokens in enumerate(sizes):
            n = tokens // BLOCK_TOKENS
            rng = np.random.default_rng(i)
            for t in layout.tensors:  # fresh contents per prefix, in the source blocks 1..n
                t[:, 1:n + 1] = torch.from_numpy(rng.standard_normal(t[:, 1:n + 1].shape, dtype=np.float32)).to(t.dtype)
            keys = chain_keys(ns, (np.arange(tokens) + 7919 * (i + 1)) % 50000)
            _progress(f"storing {tokens} tokens ({n * record_bytes(layout.shape) / (1 << 20):.0f} MiB)")
            assert store.submit_offload(layout, list(range(1, n + 1)), keys, parents_of(keys)), "offload dropped"
            assert store.drain(300), "the offload did not finish"
            rows += _restore_prefix(store, proxy, layout, keys, tokens, args, args.recompute_tokens_per_s)
        return rows
    finally:
        if store is not None:
            store.close()
        proxy.close()


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    server = None
    endpoint = args.s3_url
    try:
        if not endpoint:  # a moto server in its own process (not sharing this one's GIL)
            from .s3 import _start_moto

            server, endpoint = _start_moto()
        asyncio.run(_make_bucket(endpoint, args))
        rows = _bench(args, endpoint)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    return {"shape": args.shape, "server": "moto (local process)" if server is not None else endpoint,
            "delay_s": args.delay_s, "recompute_tokens_per_s": args.recompute_tokens_per_s, "rows": rows}


async def _make_bucket(endpoint: str, args: argparse.Namespace) -> None:
    b = S3Backend(args.bucket, "", endpoint_url=endpoint, access_key=args.access_key, secret_key=args.secret_key,
                  create_bucket=True)
    await b.open()
    await b.close()


def format_result(res: dict) -> str:
    """One row per prefix, mode and repeat: how long the restore took against its bound, and what it served."""
    rows = [[r["tokens"], r["mode"], r["seconds"], r["bound_s"], r["recompute_budget_s"], r["restored"],
             r["recomputed"], r["wrong_bytes"], r["lost"], r["hedges_sent"], r["hedges_won"], r["retries"],
             ",".join(f"{k}={int(v)}" for k, v in r["abandoned"].items() if v) or "-"]
            for r in res["rows"]]
    return table(["tokens", "mode", "s", "bound s", "budget s", "restored", "recomputed", "wrong B", "lost",
                  "hedges", "won", "retries", "abandoned"], rows,
                 fmts=["", "", ".2f", ".2f", ".2f", "", "", "", "", "", "", "", ""],
                 title=f"restores through a fault proxy ({res['shape']}, server: {res['server']}, "
                       f"delay {res['delay_s']:g} s)")
