"""The ``crypto`` measure: what sealing records at rest costs a restore and a write.

For each size (``--tokens``, blocks of 16 tokens sized like ``restore_store``'s), in one process
and interleaved round by round (the order of on and off flips every round, so device and cache
drift hit both), with encryption on and off:

* ``ssd load``: ``TieredStore.load`` from SSD segments (host tier off);
* ``object load``: ``TieredStore.load`` from the object tier alone (written through a scratch SSD
  tier, persisted, reopened without SSD and host), on a local directory (``file://``) or S3
  (``--s3-endpoint``);
* ``ssd write``: ``submit_offload`` + ``drain`` of fresh blocks into the SSD tier (host off).

Every file of a store's directory is dropped from the page cache (POSIX_FADV_DONTNEED) before
each load, as ``restore_store`` does. The ratio reported is on/off in throughput (off time / on
time): 1.0 costs nothing, the goal is >= 0.8. Each row also gives the process's CPU time per
operation (all its threads: less sensitive to other processes on the machine than wall time).
For context, the raw AES-256-GCM seal and open rate of ``RecordCipher`` on one thread over
records of the same size, on the sealed tier's paths (a batch; seal from a source into a buffer
with room for the tag, open in place).

Threads: the caller's thread drives everything; each store runs its own loop thread.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...blocks.codec import record_bytes
from ...blocks.keys import BlockKey, chain_keys, parents_of
from ...blocks.tenant import tenant_id
from ...config import TieredKVConfig
from ...factory import build_store
from ...store import TieredStore
from ...tenants.cipher import TAG_BYTES, RecordCipher
from ..report import progress
from ..restore_store import BUCKET, _drop_cache, _files, _layout, _make_bucket
from .flood import BLOCK_TOKENS, SALT

#: staging for the crypto stores: one write of the largest size fits in the free slabs
SLAB_BYTES, SLABS = 16 << 20, 8
#: the tenant whose records are written and restored
TENANT = tenant_id("crypto", deployment_salt=SALT)
#: passes of the raw cipher run; the fastest is kept
RAW_PASSES = 3
#: goal for on/off throughput of every path
GOAL_RATIO = 0.8


def _cfg(path: str, enc: bool, d: str, keks: str, args: argparse.Namespace, *, ssd: bool, cap: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"metrics_port": None, "host_capacity_bytes": 0, "staging_slab_bytes": SLAB_BYTES,
                           "staging_slabs": SLABS, "ssd_io": args.ssd_io}
    if ssd:
        cfg.update(ssd_dir=os.path.join(d, "ssd"), ssd_capacity_bytes=cap)
    if path == "object":
        if args.s3_endpoint:
            cfg.update(object_url=f"s3://{BUCKET}/tenants-crypto-{os.getpid()}-{'on' if enc else 'off'}",
                       s3_endpoint_url=args.s3_endpoint)
        else:
            cfg["object_url"] = f"file://{d}/objects"
    if enc:
        cfg.update(encryption="on", encryption_keys=f"file://{keks}")
    return cfg


def _wait_found(store: TieredStore, keys: list[BlockKey], timeout: float = 60.0) -> None:
    """The object tier indexes in the background after open: wait until every key is found."""
    end = time.monotonic() + timeout
    while (found := store.lookup(keys).num_blocks) < len(keys):
        if time.monotonic() > end:
            raise RuntimeError(f"only {found} of {len(keys)} blocks are restorable after {timeout:.0f} s")
        time.sleep(0.05)


class _Stores:
    """The four stores (SSD and object tier, encryption on and off) and the blocks they hold."""

    def __init__(self, args: argparse.Namespace, root: str, n: int, rounds: int) -> None:
        self.layout, self.ns, self.keys = _layout(args.shape, n)
        self.rb = record_bytes(self.layout.shape)
        keks = os.path.join(root, "keks")
        fd = os.open(keks, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a key: readable by us only
        with os.fdopen(fd, "w") as f:
            f.write(f"v1={base64.b64encode(os.urandom(32)).decode()}\n")
        # every write round adds each size once; room for all of them and the restored blocks
        cap = max(64 << 20, 4 * (rounds + 2) * n * self.rb)
        self.stores: dict[tuple[str, bool], TieredStore] = {}
        self.dirs: dict[tuple[str, bool], str] = {}
        try:
            for path in ("ssd", "object"):
                for enc in (False, True):
                    self._open(path, enc, os.path.join(root, f"{path}-{'on' if enc else 'off'}"), keks, args, cap)
        except BaseException:
            self.close()
            raise

    def _open(self, path: str, enc: bool, d: str, keks: str, args: argparse.Namespace, cap: int) -> None:
        """Write the blocks into a store of ``path``; for objects, reopen it on the object tier alone."""
        os.makedirs(d)
        n = len(self.keys)
        store = build_store(TieredKVConfig.from_mapping(_cfg(path, enc, d, keks, args, ssd=True, cap=cap)), self.ns)
        try:
            if not store.submit_offload(self.layout, list(range(1, n + 1)), self.keys, parents_of(self.keys),
                                        tenant=TENANT):
                raise RuntimeError("the crypto bench's blocks were dropped: raise staging")
            store.drain(300)
            if path == "object":  # objects only from here on: no SSD, no host
                store.persist(300)
                store.close()
                store = build_store(TieredKVConfig.from_mapping(_cfg(path, enc, d, keks, args, ssd=False, cap=cap)),
                                    self.ns)
            _wait_found(store, self.keys)
        except BaseException:
            store.close()
            raise
        self.stores[(path, enc)] = store
        self.dirs[(path, enc)] = d

    def close(self) -> None:
        for s in self.stores.values():
            s.close()

    def load(self, path: str, enc: bool, n: int) -> tuple[float, float]:
        """Seconds (wall, process CPU) to restore the first ``n`` blocks, from a cold page cache."""
        store = self.stores[(path, enc)]
        _drop_cache(_files(self.dirs[(path, enc)]))
        c0, t0 = time.process_time(), time.perf_counter()
        res = store.load(self.layout, list(range(1, n + 1)), self.keys[:n], timeout=120)
        dt = time.perf_counter() - t0, time.process_time() - c0
        if res.failed_block_ids:
            raise RuntimeError(f"{path} load (encryption {'on' if enc else 'off'}): {len(res.failed_block_ids)} "
                               f"of {n} blocks failed")
        return dt

    def write(self, enc: bool, keys: list[BlockKey]) -> tuple[float, float]:
        """Seconds (wall, process CPU) to offload ``keys`` (fresh blocks) into the SSD tier until written."""
        store = self.stores[("ssd", enc)]
        c0, t0 = time.process_time(), time.perf_counter()
        if not store.submit_offload(self.layout, list(range(1, len(keys) + 1)), keys, parents_of(keys),
                                    tenant=TENANT):
            raise RuntimeError("a crypto write was dropped: raise staging")
        store.drain(120)
        return time.perf_counter() - t0, time.process_time() - c0


def raw_cipher(rb: int, total_bytes: int) -> dict[str, Any]:
    """AES-256-GCM seal, then open, of ``RecordCipher`` on this thread over ``total_bytes`` of
    records of ``rb`` bytes in memory, as the sealed tier runs them: one batch per pass, each record
    sealed from its source into a buffer with room for the tag, then opened there in place."""
    key = os.urandom(32)
    cipher = RecordCipher(lambda _tenant, _create: key)
    count = max(4, total_bytes // rb)
    data = np.random.default_rng(0).integers(0, 256, count * rb, dtype=np.uint8)
    out = np.zeros(count * rb + TAG_BYTES, np.uint8)
    sources = [memoryview(data[i * rb:(i + 1) * rb]) for i in range(count)]
    sealed = [memoryview(out[i * rb:(i + 1) * rb + TAG_BYTES]) for i in range(count)]  # record i + tag scratch
    aad = bytes(32)
    cipher.open(TENANT, aad, bytearray(rb), cipher.seal(TENANT, aad, bytearray(rb)))  # warm: key, DEK
    seal_s = open_s = float("inf")
    opened = 0
    for _ in range(RAW_PASSES):  # the best pass: other processes share the core
        t0 = time.perf_counter()
        batch = cipher.batch()
        seals = [batch.seal(TENANT, aad, src, out=dst) for src, dst in zip(sources, sealed)]
        t1 = time.perf_counter()
        batch = cipher.batch()
        opened = sum(batch.open(TENANT, aad, dst[:rb], seal) for dst, seal in zip(sealed, seals))
        t2 = time.perf_counter()
        seal_s, open_s = min(seal_s, t1 - t0), min(open_s, t2 - t1)
    nbytes = count * rb
    return {"record_bytes": rb, "mib": nbytes / (1 << 20), "seal_gbps": nbytes / seal_s / 1e9,
            "open_gbps": nbytes / open_s / 1e9, "seal_us_per_record": seal_s / count * 1e6,
            "open_us_per_record": open_s / count * 1e6,
            "all_opened": opened == count and np.array_equal(out[:nbytes], data)}


def run_crypto(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Interleaved rounds of every path and size, encryption on and off (module docstring)."""
    sizes = [int(t) // BLOCK_TOKENS for t in args.tokens.split(",")]
    n = max(sizes)
    if args.s3_endpoint:
        asyncio.run(_make_bucket(args.s3_endpoint))
    progress("tenants", f"crypto: writing {n} blocks into SSD and object tiers, encryption on and off")
    st = _Stores(args, root, n, args.rounds)
    times: dict[tuple[str, int, bool], list[tuple[float, float]]] = {}
    try:
        fresh = 0
        for r in range(args.rounds + 1):  # round 0 warms up (keys, DEKs, first reads)
            order = (False, True) if r % 2 else (True, False)
            for size in sizes:
                for enc in order:
                    for path in ("ssd", "object"):
                        _keep(times, r, (f"{path} load", size, enc), st.load(path, enc, size))
                    fresh += 1
                    tokens = np.arange(size * BLOCK_TOKENS, dtype=np.int64) + 900_000_000 + fresh * 65_536
                    keys = chain_keys(st.ns, tokens)
                    _keep(times, r, ("ssd write", size, enc), st.write(enc, keys))
            if r:
                progress("tenants", f"crypto: round {r}/{args.rounds} done")
        open_failures = {f"{p}-{'on' if e else 'off'}": getattr(s.tiers[-1], "open_failures", None)
                         for (p, e), s in st.stores.items()}
    finally:
        st.close()
    rows = []
    for what in ("ssd load", "object load", "ssd write"):
        for size in sizes:
            rows.append(_row(what, size, st.rb, times[(what, size, False)], times[(what, size, True)]))
    raw = raw_cipher(st.rb, args.cipher_mib << 20)
    worst = min(r["ratio_median"] for r in rows)
    return {"shape": args.shape, "record_bytes": st.rb, "rounds": args.rounds,
            "object_store": "s3" if args.s3_endpoint else "file", "rows": rows, "raw_cipher": raw,
            "open_failures": open_failures,
            "goal": {"target": GOAL_RATIO, "worst_ratio": worst, "met": worst >= GOAL_RATIO}}


def _keep(times: dict[tuple[str, int, bool], list[tuple[float, float]]], r: int, k: tuple[str, int, bool],
          dt: tuple[float, float]) -> None:
    if r:
        times.setdefault(k, []).append(dt)


def _row(what: str, blocks: int, rb: int, off_runs: list[tuple[float, float]],
         on_runs: list[tuple[float, float]]) -> dict[str, Any]:
    nbytes = blocks * rb
    off, on = [w for w, _ in off_runs], [w for w, _ in on_runs]
    ratios = [a / b for a, b in zip(off, on)]
    gbps: Callable[[float], float] = lambda s: nbytes / s / 1e9  # noqa: E731
    return {"path": what, "tokens": blocks * BLOCK_TOKENS, "blocks": blocks, "mib": nbytes / (1 << 20),
            "off_ms": statistics.median(off) * 1e3, "on_ms": statistics.median(on) * 1e3,
            "off_cpu_ms": statistics.median(c for _, c in off_runs) * 1e3,
            "on_cpu_ms": statistics.median(c for _, c in on_runs) * 1e3,
            "off_gbps": gbps(statistics.median(off)), "on_gbps": gbps(statistics.median(on)),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
