"""The ``erasure`` measure: how fast, and how completely, ``dtkv tenants erase`` takes a tenant's KV.

Each run, with encryption off and on (fresh directories and a fresh bucket prefix each):

1. node A (this process; ``build_store`` with host, SSD and object tiers) writes ``--erase-blocks``
   blocks of the tenant to erase and as many of a tenant that stays, persists them (SSD segments
   sealed, records flushed to the bucket) and keeps running;
2. node B (a second process: its own SSD directory, the same bucket) waits until its catalog (the
   object index) lists the erased tenant's blocks, restores them, writes any its SSD still lacks,
   and stops (its close flushes its copies too: more objects to erase). Node B is down while the
   erase runs, the case the bound of docs/TENANTS.md covers last;
3. ``dtkv tenants erase id:<hex> BUCKET`` runs in its own process, as an operator runs it;
4. node A, still running: seconds from the command's start until none of its tiers holds a block
   of the tenant (its index refresh, ``--erase-refresh-s``, plus the store's 5 s sweep);
5. a new process on node B's view (B's SSD directory and the bucket), started when the command
   is done (while node A runs on): seconds from the command's start, and from the process's own
   store opening, until none of its tiers (host, SSD, object index) holds a block of the tenant;
   and what it could restore right after opening (without encryption its SSD may serve for up to
   one sweep; with it, nothing: the key is gone);
6. every node stopped, bytes of the erased tenant left readable anywhere: records of the tenant in
   both SSD directories and in every object of the bucket, found by their record header as ``dtkv
   fsck`` reads them, that verify (plain records) or could still be opened (sealed records: while
   the tenant's key exists); the records the bucket's manifests still list (``dtkv fsck``'s check
   of erased tenants); and 64-byte runs of the tenant's KV bytes in any file or object. Goal: 0.
   The kept tenant's readable bytes are counted the same way (they must not be 0: the scan finds
   records).

The bucket is a local directory by default, a moto server in its own process with ``--erase-bucket
moto``, or S3 at ``--s3-endpoint``. Nodes B run as ``python -c`` children of this process
(``node_main``); all times are wall-clock seconds (``time.time``) so processes compare them.

Threads: the caller's thread drives everything; node A's store runs its own loop thread.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...blocks.codec import MAGIC, record_bytes, verify_record
from ...blocks.keys import BlockKey, Namespace, chain_keys, parents_of
from ...blocks.layout import EngineLayout
from ...blocks.tenant import tenant_hex, tenant_id
from ...config import TieredKVConfig
from ...errors import RecordError
from ...factory import build_store
from ...store import TieredStore
from ..report import progress, table
from ..restore_store import BUCKET, _layout, _make_bucket
from .flood import BLOCK_TOKENS, SALT

#: the tenant erased, and one that must keep everything
ERASED, KEPT = tenant_id("erased", deployment_salt=SALT), tenant_id("kept", deployment_salt=SALT)
#: the payload's seed: node A and node B write the same bytes for the same keys
SEED = 1234
#: staging of the nodes: one write of every block of a tenant fits in a slab
SLAB_BYTES, SLABS = 16 << 20, 4
#: the store's erasure sweep (``TieredStore(sweep_interval_s=)``, not a setting): part of the bound
SWEEP_S = 5.0
#: blocks whose 64-byte KV runs are searched for (first, middle, last), runs per layer plane
RUN_BLOCKS, RUNS_PER_PLANE = 3, 4
_NODE_ENTRY = ("import sys\nfrom dynamo_tiered_kv.bench.tenants.erasure import node_main\n"
               "sys.exit(node_main(sys.argv[1:]))")


# --- the workload, the same in every process --------------------------------------------------------
def _workload(shape: str, n: int) -> tuple[EngineLayout, Namespace, dict[bytes, list[BlockKey]]]:
    """The engine layout (seeded payload), its namespace and each tenant's chain of ``n`` blocks
    (the erased tenant's in engine blocks 1..n, the kept one's in n+1..2n)."""
    torch.manual_seed(SEED)
    layout, ns, _ = _layout(shape, 2 * n)
    tokens = np.arange(n * BLOCK_TOKENS, dtype=np.int64)
    chains = {ERASED: chain_keys(ns, tokens + 10_000_000), KEPT: chain_keys(ns, tokens + 20_000_000)}
    return layout, ns, chains


def _ids(tenant: bytes, n: int) -> list[int]:
    return list(range(1, n + 1)) if tenant == ERASED else list(range(n + 1, 2 * n + 1))


def _held(store: TieredStore, keys: Sequence[BlockKey]) -> dict[str, int]:
    """Blocks of ``keys`` each tier of ``store`` holds (its in-memory index)."""
    return {t.name: sum(1 for k in keys if t.contains(k)) for t in store.tiers}


def _object_ready(store: TieredStore) -> bool:
    return all(getattr(t, "index_ready", True) for t in store.tiers)


def _restorable(store: TieredStore, layout: EngineLayout, ids: list[int], keys: list[BlockKey]) -> int:
    """Blocks of ``keys`` a load restores now (a prefix: failures form a suffix)."""
    return len(store.load(layout, ids, keys, timeout=60).loaded_block_ids)


def _wait(cond: Any, deadline: float, every: float = 0.05) -> bool:
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(every)
    return True


# --- node B and the new process on its view (child processes) ---------------------------------------
def node_main(argv: list[str]) -> int:
    """A child node (``python -c``): ``argv[0]`` is its JSON spec; prints one JSON line."""
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    layout, ns, chains = _workload(spec["shape"], spec["n"])
    mine, other = chains[ERASED], chains[KEPT]
    ids = _ids(ERASED, spec["n"])
    deadline = time.time() + spec["timeout_s"]
    opened = time.time()
    store = build_store(TieredKVConfig.from_mapping(spec["cfg"]), ns)
    try:
        if spec["mode"] == "fill":
            out = _fill(store, layout, ids, mine, deadline)
        else:
            out = _probe(store, layout, ids, mine, other, opened, deadline)
    finally:
        store.close()
    print(json.dumps(out), flush=True)
    return 0


def _fill(store: TieredStore, layout: EngineLayout, ids: list[int], keys: list[BlockKey],
          deadline: float) -> dict[str, Any]:
    """Node B: the tenant's blocks in its catalog, restored, and in its own SSD."""
    listed = _wait(lambda: _object_ready(store) and _held(store, keys).get("object", 0) == len(keys), deadline)
    restored = _restorable(store, layout, ids, keys)
    store.drain(60)
    if _held(store, keys).get("ssd", 0) < len(keys):  # a restore fills host memory; the SSD takes writes
        store.submit_offload(layout, ids, keys, parents_of(keys), tenant=ERASED)
        store.drain(60)
    return {"catalog_listed": listed, "restored": restored, "held": _held(store, keys)}


def _probe(store: TieredStore, layout: EngineLayout, ids: list[int], keys: list[BlockKey],
           other: list[BlockKey], opened: float, deadline: float) -> dict[str, Any]:
    """A new process on node B's view: when does it find none of the tenant's blocks?"""
    ready_at = time.time()
    held_at_open = sum(_held(store, keys).values())
    restored_at_open = _restorable(store, layout, ids, keys)
    clean = _wait(lambda: _object_ready(store) and sum(_held(store, keys).values()) == 0, deadline)
    clean_at = time.time() if clean else None
    return {"opened_at": opened, "store_ready_s": ready_at - opened, "clean_at": clean_at,
            "held_at_open": held_at_open, "restored_at_open": restored_at_open,
            "held_at_end": _held(store, keys), "restored_at_end": _restorable(store, layout, ids, keys),
            "kept_tenant_found": sum(1 for k in other if any(t.contains(k) for t in store.tiers))}


def _start_child(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _NODE_ENTRY, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _child_result(proc: subprocess.Popen[str], spec: dict[str, Any]) -> dict[str, Any]:
    """The child's JSON line, once it exited (killed past its timeout)."""
    try:
        out, err = proc.communicate(timeout=spec["timeout_s"] + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"erasure node ({spec['mode']}) failed, exit {proc.returncode}: {err[-3000:]}")
    return json.loads(lines[-1])


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    return _child_result(_start_child(spec), spec)


# --- what is left -------------------------------------------------------------------------------------
def _payload_runs(layout: EngineLayout, ids: list[int]) -> list[bytes]:
    """64-byte runs of the engine's KV bytes of a few of ``ids``' blocks (each plane of two layers)."""
    picks = sorted({ids[0], ids[len(ids) // 2], ids[-1]})[:RUN_BLOCKS]
    out = []
    for j in range(min(2, len(layout.layer_views))):
        for b in picks:
            a = np.ascontiguousarray(np.asarray(layout.layer_views[j][b])).view(np.uint8).reshape(-1)
            step = max(64, a.size // RUNS_PER_PLANE)
            out += [a[i:i + 64].tobytes() for i in range(0, a.size - 63, step)]
    return out


class _Left:
    """Readable bytes per tenant in files and objects, and plaintext runs of the erased tenant."""

    def __init__(self, runs: list[bytes], key_exists: dict[bytes, bool]) -> None:
        self.runs, self.key_exists = runs, key_exists
        self.readable: dict[bytes, int] = {ERASED: 0, KEPT: 0}
        self.readable_records = 0
        self.sealed_present = 0  # bytes of sealed records of the erased tenant still stored (keyless)
        self.plaintext_runs = 0
        self.scanned_bytes = 0

    def scan(self, blob: bytes) -> None:
        """Every record in ``blob`` (found by its magic, then its header, as fsck reads records)."""
        self.scanned_bytes += len(blob)
        self.plaintext_runs += sum(blob.count(r) for r in self.runs)
        view = memoryview(blob)
        pos = blob.find(MAGIC)
        while pos >= 0:
            step = 1
            try:
                hdr = verify_record(view[pos:])
            except RecordError:
                hdr = None
            if hdr is not None and hdr.tenant in self.readable and pos + hdr.record_bytes <= len(blob):
                step = hdr.record_bytes
                if not hdr.sealed or self.key_exists[hdr.tenant]:
                    self.readable[hdr.tenant] += hdr.record_bytes
                    self.readable_records += hdr.tenant == ERASED
                elif hdr.tenant == ERASED:
                    self.sealed_present += hdr.record_bytes
            pos = blob.find(MAGIC, pos + step)


async def _scan_bucket(url: str, s3: dict[str, Any], left: _Left, keks: str | None) -> dict[str, Any]:
    """The bucket's objects through ``left``; whether each tenant's key is still there; records the
    manifests still list for erased tenants (``dtkv fsck``)."""
    from ...tenants.kek import KeySource
    from ...tenants.keystore import TenantKeyStore
    from ...tiers.objectstore import backend_from_url
    from ...tiers.objectstore.tenants import erased_records_left

    backend = backend_from_url(url, **s3)
    await backend.open()
    try:
        if keks is not None:
            keys = TenantKeyStore(backend, KeySource.from_file(keks), key_cache_s=0, absent_cache_s=0)
            for t in left.key_exists:
                left.key_exists[t] = await keys.get(t) is not None
        objects = await backend.list("")
        for info in objects:
            body = await backend.get_bytes(info.name)
            if body is not None:
                left.scan(bytes(body))
        listed = await erased_records_left(backend)
        return {"objects": len(objects), "listed_records": listed.get(ERASED, 0)}
    finally:
        await backend.close()


async def _clear_bucket(url: str, s3: dict[str, Any]) -> None:
    from ...tiers.objectstore import backend_from_url

    backend = backend_from_url(url, **s3)
    await backend.open()
    try:
        for info in await backend.list(""):
            await backend.delete(info.name)
    finally:
        await backend.close()


# --- one run -------------------------------------------------------------------------------------------
def _cfg(root: str, ssd: str, url: str, enc: bool, args: argparse.Namespace, rb: int) -> dict[str, Any]:
    n = args.erase_blocks
    cfg: dict[str, Any] = {"metrics_port": None, "host_capacity_bytes": 4 * n * rb + (64 << 20),
                           "ssd_dir": os.path.join(root, ssd), "ssd_capacity_bytes": max(64 << 20, 8 * n * rb),
                           "staging_slab_bytes": SLAB_BYTES, "staging_slabs": SLABS, "ssd_io": args.ssd_io,
                           "object_url": url, "object_refresh_s": args.erase_refresh_s}
    if args.s3_endpoint:
        cfg["s3_endpoint_url"] = args.s3_endpoint
    if enc:
        cfg.update(encryption="on", encryption_keys=f"file://{os.path.join(root, 'keks')}")
    return cfg


def _erase_command(url: str, endpoint: str | None) -> tuple[float, dict[str, Any]]:
    """``dtkv tenants erase`` in its own process: (its start, its JSON report)."""
    cmd = [sys.executable, "-m", "dynamo_tiered_kv.cli", "tenants", "erase", f"id:{tenant_hex(ERASED)}", url, "--json"]
    if endpoint:
        cmd += ["--s3-endpoint-url", endpoint]
    started = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"dtkv tenants erase failed, exit {r.returncode}: {r.stderr[-3000:]}")
    return started, {**json.loads(r.stdout), "command_s": time.time() - started}


def run_one(args: argparse.Namespace, root: str, url: str, enc: bool) -> dict[str, Any]:
    """One run (module docstring, steps 1-6) in ``root``, on the bucket ``url``."""
    n, timeout = args.erase_blocks, args.erase_timeout_s
    layout, ns, chains = _workload(args.shape, n)
    rb = record_bytes(layout.shape)
    keks = os.path.join(root, "keks") if enc else None
    if keks is not None:
        fd = os.open(keks, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a key: readable by us only
        with os.fdopen(fd, "w") as f:
            f.write(f"v1={base64.b64encode(os.urandom(32)).decode()}\n")
    s3 = {"endpoint_url": args.s3_endpoint} if args.s3_endpoint else {}
    out: dict[str, Any] = {"encryption": "on" if enc else "off", "blocks": n, "record_bytes": rb}
    a = build_store(TieredKVConfig.from_mapping(_cfg(root, "ssd-a", url, enc, args, rb)), ns)
    try:
        for tenant, keys in chains.items():
            if not a.submit_offload(layout, _ids(tenant, n), keys, parents_of(keys), tenant=tenant):
                raise RuntimeError("node A dropped the blocks: raise staging")
        a.persist(120)
        out["node_a_before"] = _held(a, chains[ERASED])
        spec = {"shape": args.shape, "n": n, "timeout_s": timeout}
        out["node_b"] = _child({**spec, "mode": "fill", "cfg": _cfg(root, "ssd-b", url, enc, args, rb)})
        started, report = _erase_command(url, args.s3_endpoint)
        out["command"] = {k: report.get(k) for k in ("records", "deleted_manifests", "rewritten_manifests",
                                                     "deleted_data", "errors", "key_destroyed", "command_s")}
        # the new process on node B's view starts as soon as the command is done, while node A runs on
        probe_spec = {**spec, "mode": "probe", "cfg": _cfg(root, "ssd-b", url, enc, args, rb)}
        child = _start_child(probe_spec)
        try:
            clean = _wait(lambda: sum(_held(a, chains[ERASED]).values()) == 0, started + timeout)
            out["running_node_clean_s"] = time.time() - started if clean else None
            out["running_node_left"] = _held(a, chains[ERASED])
            out["running_node_kept"] = _held(a, chains[KEPT])
        finally:
            probe = _child_result(child, probe_spec)
    finally:
        a.close()
    clean_at = probe.pop("clean_at")
    probe["clean_after_erase_s"] = clean_at - started if clean_at is not None else None
    probe["clean_after_open_s"] = clean_at - probe["opened_at"] if clean_at is not None else None
    probe["opened_after_erase_s"] = probe.pop("opened_at") - started
    out["new_process"] = probe
    left = _Left(_payload_runs(layout, _ids(ERASED, n)), {ERASED: enc, KEPT: enc})  # read from the bucket
    bucket = asyncio.run(_scan_bucket(url, s3, left, keks))
    for ssd in ("ssd-a", "ssd-b"):
        for d, _, files in os.walk(os.path.join(root, ssd)):
            for name in files:
                with open(os.path.join(d, name), "rb") as f:
                    left.scan(f.read())
    out["left"] = {"readable_bytes": left.readable[ERASED], "readable_records": left.readable_records,
                   "listed_records": bucket["listed_records"], "plaintext_runs": left.plaintext_runs,
                   "sealed_bytes_keyless": left.sealed_present,
                   "key_exists": left.key_exists[ERASED] if enc else None,
                   "kept_tenant_readable_bytes": left.readable[KEPT], "scanned_bytes": left.scanned_bytes,
                   "bucket_objects": bucket["objects"]}
    return out


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got and len(got) == len(xs) else None


def run_erasure(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """``--erase-runs`` runs with encryption off and on, interleaved; results and a summary."""
    server = None
    if not args.s3_endpoint and args.erase_bucket == "moto":
        from ..s3 import _start_moto

        server, args.s3_endpoint = _start_moto()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    where = "moto (local process)" if server is not None else ("S3 " + args.s3_endpoint if args.s3_endpoint
                                                               else "local directory")
    runs: list[dict[str, Any]] = []
    try:
        if args.s3_endpoint:
            asyncio.run(_make_bucket(args.s3_endpoint))
        for i in range(args.erase_runs):
            for enc in ((False, True) if i % 2 == 0 else (True, False)):
                mode = "on" if enc else "off"
                d = os.path.join(root, f"run{i}-{mode}")
                os.makedirs(d)
                url = (f"s3://{BUCKET}/tenants-erasure-{os.getpid()}-{i}-{mode}" if args.s3_endpoint
                       else f"file://{d}/bucket")
                progress("tenants", f"erasure run {i + 1}/{args.erase_runs}, encryption {mode}: "
                         f"{args.erase_blocks} blocks per tenant, object_refresh_s {args.erase_refresh_s:g}")
                try:
                    runs.append({"run": i, **run_one(args, d, url, enc)})
                finally:
                    if args.s3_endpoint:
                        asyncio.run(_clear_bucket(url, {"endpoint_url": args.s3_endpoint}))
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
            args.s3_endpoint = None
    summary: dict[str, Any] = {}
    for mode in ("off", "on"):
        rs = [r for r in runs if r["encryption"] == mode]
        new = [r["new_process"]["clean_after_erase_s"] for r in rs]
        summary[mode] = {
            "new_process_clean_after_erase_s": {"median": _median(new), "max": max(new) if None not in new else None},
            "new_process_clean_after_open_s": _median([r["new_process"]["clean_after_open_s"] for r in rs]),
            "running_node_clean_s": _median([r["running_node_clean_s"] for r in rs]),
            "command_s": _median([r["command"]["command_s"] for r in rs]),
            "restored_at_open": max(r["new_process"]["restored_at_open"] for r in rs),
            "readable_bytes": sum(r["left"]["readable_bytes"] for r in rs),
            "plaintext_runs": sum(r["left"]["plaintext_runs"] for r in rs),
            "listed_records": sum(r["left"]["listed_records"] for r in rs)}
    left = sum(s["readable_bytes"] + s["plaintext_runs"] + s["listed_records"] for s in summary.values())
    finite = all(r["new_process"]["clean_after_erase_s"] is not None and r["running_node_clean_s"] is not None
                 for r in runs)
    return {"object_store": where, "shape": args.shape, "refresh_s": args.erase_refresh_s, "sweep_s": SWEEP_S,
            "runs": runs, "summary": summary,
            "goal": {"readable_bytes_left": left, "all_clean_in_time": finite, "met": left == 0 and finite}}


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_erasure(res: dict[str, Any]) -> list[str]:
    """The erasure measure's tables (``dtkv bench tenants`` output)."""
    rows = []
    for r in res["runs"]:
        p, left = r["new_process"], r["left"]
        rows.append([r["run"], r["encryption"], r["command"]["records"], _s(r["command"]["command_s"]),
                     _s(r["running_node_clean_s"]), _s(p["clean_after_erase_s"]), _s(p["clean_after_open_s"]),
                     f"{p['held_at_open']}/{p['restored_at_open']}", left["readable_bytes"], left["plaintext_runs"],
                     left["listed_records"], left["kept_tenant_readable_bytes"] >> 10])
    goal = res["goal"]
    return [table(["run", "encryption", "records erased", "command s", "running node clean s",
                   "new process clean s (from erase)", "(from open)", "held/restorable at open",
                   "readable bytes left", "KV runs left", "listed left", "kept tenant KiB"], rows,
                  title=f"erasure: {res['runs'][0]['blocks'] if res['runs'] else 0} blocks per tenant on node A "
                  f"(host, SSD, bucket) and node B (SSD), bucket on {res['object_store']}, object_refresh_s "
                  f"{res['refresh_s']:g}, sweep {res['sweep_s']:g} s"),
            f"goal: no readable byte of the erased tenant left (SSD directories, every object, manifests), every "
            f"node clean within the bound: {goal['readable_bytes_left']} left, "
            f"{'all' if goal['all_clean_in_time'] else 'NOT all'} clean in time: {'met' if goal['met'] else 'MISSED'}"]
