"""One phase of ``bench tiering`` in its own process: vLLM 0.33's ``TieringOffloadingManager`` with
its CPU primary and ONE secondary tier (ours, vLLM's ``fs`` or vLLM's ``obj``).

Run as ``python -m dynamo_tiered_kv.bench.tiering.phases '<json>'`` with vLLM 0.33 first on
``sys.path`` (``side_by_side`` starts it so); the last stdout line is the phase's JSON result.
A phase is one process so that "stored in one process, looked up in another" is what a restart
does, and so every load starts with nothing of the tier in this process's memory.

The GPU worker's part (copying blocks between GPU and the primary region) is played by writing
and reading the primary rows directly, as vLLM's worker would.

Phases: ``store`` (prefixes through the cascade; time until every tier job and, for ours, every
accepted write is done), ``load`` (every stored prefix looked up in a fresh process: HIT count,
promotion time, bytes checked against what was stored), ``lookup`` (the tier's own lookup for
many keys, resolved to HIT/MISS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
import uuid
from typing import Any

import numpy as np

from .. import osd_delay

TOKENS_PER_BLOCK = 16
BLOCKS_PER_CHUNK = 16  # one offload chunk: 256 tokens
TOKENS_PER_CHUNK = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
OURS = {"type": "DynamoTieredKVTier", "module_path": "dynamo_tiered_kv.connectors.vllm_tiering"}


def _nixl_with_obj_plugin() -> None:
    """Import NIXL's CUDA 12 build when no CUDA is loaded: NIXL's meta package picks its CUDA 13
    build on a CPU-only host, whose OBJ plugin needs a library CUDA 12's build does not."""
    if "nixl" in sys.modules:
        return
    fake = "cuda.bindings" not in sys.modules
    if fake:
        mod = types.ModuleType("cuda.bindings")
        mod.__version__ = "12.9"  # type: ignore[attr-defined]
        sys.modules["cuda.bindings"] = mod
    try:
        import nixl  # noqa: F401
    except ImportError:
        pass
    finally:
        if fake:
            sys.modules.pop("cuda.bindings", None)


def tier_entry(spec: dict[str, Any]) -> dict[str, Any]:
    kind = spec["tier"]
    if kind in ("dtkv", "dtkv-s3"):
        return {**OURS, **spec["settings"]}
    if kind == "fs":
        return {"type": "fs", **spec["settings"]}
    if kind == "obj":
        _nixl_with_obj_plugin()
        return {"type": "obj", **spec["settings"]}
    raise ValueError(f"unknown tier {kind!r}")


def build(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(spec, manager, tier) the way vLLM builds them from an ``OffloadingConfig``."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from ...connectors.vllm_tiering.key_mapping import declared_model

    row = spec["row_bytes"]
    blocks_per_chunk = spec.get("blocks_per_chunk", BLOCKS_PER_CHUNK)
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": spec["primary_chunks"] * row,
             "secondary_tiers": [tier_entry(spec)], "tier_poll_interval_s": 0}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK, layer_names=("kv",), group_id=0),),
        worker_kv_bytes_per_block=row // blocks_per_chunk, enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"dtkv-bench-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=spec["model"], dtype="bfloat16", max_model_len=1 << 20),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    tspec = TieringOffloadingSpec(config)
    with declared_model(config.engine_id, config.model.name, config.model.name):  # no engine: the name is the model
        manager = tspec.get_manager()
    (tier,) = manager.secondary_tiers
    return tspec, manager, tier


def prefix_keys(prefix: int, chunks: int, tag: str) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"{tag}/{prefix}/{c}".encode().ljust(32, b"."), 0) for c in range(chunks)]


class Rows:
    """Deterministic chunk bytes: one random body per chunk index, stamped with (prefix, chunk)."""

    def __init__(self, chunks: int, row_bytes: int) -> None:
        self.body = np.random.default_rng(1234).integers(0, 256, (chunks, row_bytes), dtype=np.uint8)

    def stamp(self, prefix: int, chunk: int) -> np.ndarray:
        return np.array([prefix, chunk], dtype="<u8").view(np.uint8)

    def fill(self, dst: np.ndarray, prefix: int, chunk: int) -> None:
        # vLLM pads each row of its region to a page: the chunk's bytes are its first row_bytes
        dst[:self.body.shape[1]] = self.body[chunk]
        dst[:16] = self.stamp(prefix, chunk)

    def same(self, got: np.ndarray, prefix: int, chunk: int) -> bool:
        return bool(np.array_equal(got[:16], self.stamp(prefix, chunk))
                    and np.array_equal(got[16:self.body.shape[1]], self.body[chunk][16:]))


def _step(manager: Any) -> None:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    with manager.lock:
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def _settle(manager: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        _step(manager)
        with manager.lock:
            if not manager.has_pending_work():
                return
        if time.monotonic() > end:
            raise TimeoutError("tier jobs did not finish")
        time.sleep(0.001)


def _new_ctx(manager: Any) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=f"r-{uuid.uuid4().hex[:8]}")
    with manager.lock:
        manager.on_new_request(ctx)
    return ctx


def _finish(manager: Any, ctx: Any) -> None:
    with manager.lock:
        manager.on_request_finished(ctx)


def phase_store(spec: dict[str, Any], manager: Any, tier: Any) -> dict[str, Any]:
    rows_of = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
    chunks, tag = spec["chunks_per_prefix"], spec["tag"]
    first = spec.get("first_prefix", 0)
    rows = Rows(chunks, spec["row_bytes"])
    pending = []
    for p in range(first, first + spec["prefixes"]):  # GPU -> primary: not timed
        ctx, ks = _new_ctx(manager), prefix_keys(p, chunks, tag)
        with manager.lock:
            out = manager.prepare_store(ks, ctx)
        if out is None:
            raise RuntimeError("primary tier full: raise primary_chunks")
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            rows.fill(rows_of[int(c)], p, ks.index(k))
        pending.append((ctx, ks))
    t0 = time.perf_counter()
    for ctx, ks in pending:  # primary -> secondary: the cascade vLLM runs on complete_store
        with manager.lock:
            manager.complete_store(ks, ctx, success=True)
    _settle(manager, spec.get("timeout_s", 600))
    jobs_done = time.perf_counter() - t0
    store = getattr(tier, "store", None)
    if store is not None:  # ours: a finished job means staged; written means on the SSD
        store.drain(spec.get("timeout_s", 600))
    written = time.perf_counter() - t0
    for ctx, _ in pending:
        _finish(manager, ctx)
    return {"jobs_done_s": jobs_done, "written_s": written, "chunks": len(pending) * chunks,
            "bytes": len(pending) * chunks * spec["row_bytes"]}


def phase_load(spec: dict[str, Any], manager: Any, tier: Any) -> dict[str, Any]:
    """Every prefix looked up as one request (all requests in the same steps, as a batch of
    requests arriving together); HIT chunks are promoted, then read back and checked."""
    from vllm.v1.kv_offload.base import LookupResult

    rows_of = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
    chunks, tag = spec["chunks_per_prefix"], spec["tag"]
    rows = Rows(chunks, spec["row_bytes"])
    reqs = [(p, _new_ctx(manager), prefix_keys(p, chunks, tag)) for p in range(spec["prefixes"])]
    verdict: dict[tuple[int, int], Any] = {}
    t0, cpu0 = time.perf_counter(), time.process_time()
    end = time.monotonic() + spec.get("timeout_s", 600)
    while len(verdict) < len(reqs) * chunks:
        for p, ctx, ks in reqs:
            for c, k in enumerate(ks):
                if (p, c) in verdict:
                    continue
                with manager.lock:
                    r = manager.lookup(k, ctx)
                if r in (LookupResult.HIT, LookupResult.MISS):
                    verdict[(p, c)] = r
        if time.monotonic() > end:
            break
        _step(manager)
        time.sleep(0.0005)
    took = time.perf_counter() - t0
    # every thread's CPU while the load is timed: not the making and checking of the test bytes
    load_cpu = time.process_time() - cpu0
    hits = sum(1 for r in verdict.values() if r == LookupResult.HIT)
    good = bad = 0
    for p, ctx, ks in reqs:
        hit = [k for c, k in enumerate(ks) if verdict.get((p, c)) == LookupResult.HIT]
        if hit:
            with manager.lock:
                ls = manager.prepare_load(hit, ctx)
            for k, cid in zip(hit, ls.chunk_ids, strict=True):
                if rows.same(rows_of[int(cid)], p, ks.index(k)):
                    good += 1
                else:
                    bad += 1
            with manager.lock:
                manager.complete_load(hit, ctx)
        _finish(manager, ctx)
    return {"load_s": took, "chunks": len(reqs) * chunks, "hits": hits, "verified": good, "wrong_bytes": bad,
            "bytes": hits * spec["row_bytes"], "load_cpu_s": load_cpu}


def phase_lookup(spec: dict[str, Any], manager: Any, tier: Any) -> dict[str, Any]:
    """The tier's own ``lookup`` for ``lookup_keys`` keys (the stored ones first), stepped until
    every key is HIT or MISS (vLLM's async lookups answer RETRY until their thread has looked)."""
    keys = run_keys(spec)
    keys += prefix_keys(10**6, spec["lookup_keys"] - len(keys), spec["tag"] + "-absent")
    t0 = time.perf_counter()
    hits, rounds = _hits(manager, tier, keys, "lookup")
    took = time.perf_counter() - t0
    return {"keys": len(keys), "hits": hits, "lookup_s": took, "rounds": rounds}


def run_keys(spec: dict[str, Any]) -> list[bytes]:
    """Every chunk key of a run's prefixes, in order."""
    first, chunks = spec.get("first_prefix", 0), spec["chunks_per_prefix"]
    return [k for p in range(first, first + spec["prefixes"]) for k in prefix_keys(p, chunks, spec["tag"])]


def _hits(manager: Any, tier: Any, keys: list[Any], req_id: str) -> tuple[int, int]:
    """(keys the tier answers HIT, lookup rounds it took), stepping the manager between rounds."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id=req_id)
    with manager.lock:
        tier.on_new_request(ctx)
    left, hits, rounds = list(keys), 0, 0
    while left:
        rounds += 1
        again = []
        with manager.lock:
            for k in left:
                r = tier.lookup(k, ctx)
                if r == LookupResult.RETRY:
                    again.append(k)
                elif r == LookupResult.HIT:
                    hits += 1
        left = again
        if left:
            _step(manager)
            time.sleep(0.0002)
    with manager.lock:
        tier.on_request_finished(ctx)
    return hits, rounds


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only), so loads read the medium."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def phase_runs(spec: dict[str, Any], manager: Any, tier: Any) -> dict[str, Any]:
    """``spec["runs"]`` repetitions of ``spec["phase"]``, each on its own prefixes (tag ``<tag>-r<i>``);
    before the loads: the lookup of ``lookup_keys`` keys, and the page cache dropped before each."""
    out: dict[str, Any] = {"runs": []}
    if spec["phase"] == "load":
        out["index_wait_s"] = _wait_object_index(tier, spec.get("timeout_s", 600))
    if spec["phase"] == "load" and spec.get("lookup_keys"):
        out["lookup"] = phase_lookup({**spec, "tag": f"{spec['tag']}-r0"}, manager, tier)
    for i in range(spec.get("first_run", 0), spec.get("first_run", 0) + spec.get("runs", 1)):
        run = {**spec, "tag": f"{spec['tag']}-r{i}"}
        dropped = drop_page_cache() if spec["phase"] == "load" and spec.get("drop_caches", True) else None
        io0, rgw0 = _proc_io(), rgw_counters(spec.get("rgw_admin_socket"))
        sent0 = _object_requests(tier)
        cpu0 = time.process_time()
        res = PHASES[spec["phase"]](run, manager, tier)
        res["cpu_s"] = time.process_time() - cpu0  # every thread of this process: the client's CPU
        io1, rgw1 = _proc_io(), rgw_counters(spec.get("rgw_admin_socket"))
        sent1 = _object_requests(tier)
        # ours with an object tier: the requests it sent, by its own counters (None: not ours)
        res["tier_requests"] = osd_delay.object_requests(sent0, sent1) if sent0 is not None and sent1 else None
        res["io"] = {k: io1[k] - io0.get(k, 0) for k in io1}
        res["s3_requests"] = {k: rgw1[k] - rgw0.get(k, 0) for k in rgw1}
        res["page_cache_dropped"] = dropped
        if spec["phase"] == "store":  # what the tier holds before the process exits (failed jobs: not)
            res["stored"] = _hits(manager, tier, run_keys(run), "stored")[0]
        out["runs"].append(res)
    return out


def _wait_object_index(tier: Any, timeout: float) -> float | None:
    """Ours with an object tier lists the bucket in the background at start; until that is done
    its lookups miss. The seconds it took (None: not our tier, or no object tier)."""
    store = getattr(tier, "store", None)
    objects = store.tiers[-1] if store is not None else None
    if objects is None or not hasattr(objects, "index_ready"):
        return None
    t0 = time.perf_counter()
    end = time.monotonic() + timeout
    while not objects.index_ready and time.monotonic() < end:
        time.sleep(0.005)
    return time.perf_counter() - t0


def _object_requests(tier: Any) -> dict[str, int] | None:
    """Request counters of our tier's object backend (None: not ours, or no object tier)."""
    store = getattr(tier, "store", None)
    backend = getattr(store.tiers[-1], "backend", None) if store is not None and store.tiers else None
    return osd_delay.stats_snapshot(backend.stats) if backend is not None else None


def rgw_counters(admin_socket: str | None) -> dict[str, int]:
    """Requests a Ceph RGW has served (its admin socket's perf counters): all, GET, PUT."""
    if not admin_socket:
        return {}
    try:
        raw = subprocess.run(["ceph", "--admin-daemon", admin_socket, "perf", "dump"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        rgw = json.loads(raw)["rgw"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return {}
    return {"all": int(rgw["req"]), "get": int(rgw["get"]), "put": int(rgw["put"])}


PHASES = {"store": phase_store, "load": phase_load, "lookup": phase_lookup}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    _owner, manager, tier = build(spec)  # the spec owns the shared region: kept alive
    try:
        res = phase_runs(spec, manager, tier)
        res["backpressure"] = type(tier.bp_detector).__name__ if tier.bp_detector is not None else None
    finally:
        t0 = time.perf_counter()
        with manager.lock:
            manager.shutdown()
        shutdown_s = time.perf_counter() - t0
    res["shutdown_s"] = shutdown_s
    print(json.dumps(res), flush=True)
    return 0


def _proc_io() -> dict[str, int]:
    """This process's I/O counters (all threads): syscalls and bytes that reached storage."""
    try:
        with open(f"/proc/{os.getpid()}/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
