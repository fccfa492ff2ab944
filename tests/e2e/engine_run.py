"""One engine phase, run in a fresh process by the e2e tests: ``python engine_run.py SPEC.json OUT.json``.

SPEC: {"model": dir, "extra_config": {...} | null (no connector), "prompts": [[ids...], ...],
       "max_tokens": n, "block_size": n, "multiprocess": bool, "rounds": [ROUND, ...]}
ROUND (all optional): {"prompts": [[ids...]] (else SPEC's), "reset_prefix_cache": bool,
       "wait_for_file": path (barrier before the round), "persist_s": seconds (seal + flush after
       the round), "wait_flush_failures": seconds (until the flusher has counted a failure),
       "touch_after": path (signal the test after the round)}
OUT:  {"rounds": [{"outputs": [[ids...]], "num_cached_tokens": [n...], "served": {...},
       "metrics": {...}, "seconds": generate wall time}]}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

METRICS = ("tier_hits_total", "tier_misses_total", "checksum_failures_total", "offload_blocks_total",
           "load_failed_blocks_total")


def _connector(llm):
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _snapshot(conn) -> dict:
    if conn is None or conn.worker is None or conn.worker.store is None:
        return {}
    store = conn.worker.store
    store.drain(60)
    m = store.metrics
    out: dict[str, float] = {}
    for name in METRICS:
        for t in [*(t.name for t in store.tiers), "none"]:
            v = m.value(name, tier=t)
            if v:
                out[f"{name}{{{t}}}"] = v
        v = m.value(name)
        if v:
            out[name] = v
    for reason in ("queue_full", "no_staging", "too_large", "closed", "encode_error"):
        v = m.value("offload_dropped_total", reason=reason)
        if v:
            out[f"offload_dropped_total{{{reason}}}"] = v
    for t in store.tiers:
        out[f"blocks{{{t.name}}}"] = t.usage().num_blocks
    flusher = getattr(store, "flusher", None)
    if flusher is not None:
        st = flusher.stats
        out.update({"flush_segments": st.flushed_segments, "flush_failures": st.failures,
                    "flush_lag_bytes": st.lag_bytes})
    return out


def _wire_tag(event) -> str:
    """The event's tag on the wire (msgspec's tagged union), else its class name."""
    tag = getattr(getattr(type(event), "__struct_config__", None), "tag", None)
    return tag if isinstance(tag, str) else type(event).__name__


def _store(conn):
    return None if conn is None or conn.worker is None else conn.worker.store


def _wait_file(path: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {path} never appeared")
        time.sleep(0.05)


def _wait_object_index(store, timeout: float = 120.0) -> None:
    """The object tier indexes the bucket in the background and misses until then (a start never
    waits on a bucket); these tests check restores, so they wait for the index first."""
    if store is None:
        return
    deadline = time.monotonic() + timeout
    while not all(getattr(t, "index_ready", True) for t in store.tiers):
        if time.monotonic() > deadline:
            raise TimeoutError("object tier index not ready")
        time.sleep(0.05)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    from dynamo_tiered_kv.connectors.vllm.events import residency_of

    kw = {}
    if spec.get("extra_config") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "TieredKVConnector",
            "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["extra_config"],
        }
    if spec.get("kv_events"):
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null"}
    if spec.get("multiprocess"):
        kw["distributed_executor_backend"] = "mp"  # worker in its own process: lookups go over the socket
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=4096, enforce_eager=True, seed=0,
              block_size=spec.get("block_size", 32), enable_prefix_caching=True, max_num_seqs=8,
              max_num_batched_tokens=4096, **kw)
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0)
    conn = _connector(llm)
    published: list = []
    if spec.get("kv_events"):  # record what the scheduler publishes (in-process engine only)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        orig = sched.kv_event_publisher.publish
        sched.kv_event_publisher.publish = lambda batch: (published.extend(batch.events), orig(batch))
    _wait_object_index(_store(conn))
    rounds = []
    for r in spec.get("rounds", [{}]):
        if r.get("wait_for_file"):
            _wait_file(r["wait_for_file"])
        if r.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        if conn is not None and conn.worker is not None:
            conn.worker.served.clear()
        prompts = [{"prompt_token_ids": p} for p in r.get("prompts", spec["prompts"])]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        store = _store(conn)
        if store is not None and r.get("persist_s"):
            store.persist(r["persist_s"])
        if store is not None and r.get("wait_flush_failures"):
            deadline = time.monotonic() + r["wait_flush_failures"]
            while store.flusher.stats.failures == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        rounds.append({
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
            "served": dict(conn.worker.served) if conn is not None and conn.worker is not None else {},
            "metrics": _snapshot(conn),
            "seconds": seconds,
            # kind: the event's wire tag (our events are vLLM's with a tenant field added)
            "dtkv_events": [{"kind": _wire_tag(e), "blocks": len(e.block_hashes),
                             "tokens": len(getattr(e, "token_ids", ())), "medium": residency_of(e),
                             "tenant": getattr(e, "dtkv_tenant", None)}
                            for e in published if hasattr(e, "medium") and residency_of(e) is not None],
        })
        published.clear()
        if r.get("touch_after"):
            Path(r["touch_after"]).write_text(json.dumps(rounds[-1]))
    with open(out_path, "w") as f:
        json.dump({"rounds": rounds}, f)
    if conn is not None:
        conn.shutdown()  # drain offloads, seal and flush, close the tiers
    if not spec.get("multiprocess"):
        # Everything is persisted; skip vLLM's few seconds of interpreter-exit teardown (in-process
        # engine only: a multiprocess engine's children must be shut down by vLLM).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
