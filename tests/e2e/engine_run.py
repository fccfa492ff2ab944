"""One engine phase, run in a fresh process by the e2e tests: ``python engine_run.py SPEC.json OUT.json``.

SPEC: {"model": dir, "extra_config": {...} | null (no connector), "prompts": [[ids...], ...],
       "max_tokens": n, "rounds": [{"reset_prefix_cache": bool}], "block_size": n}
OUT:  {"rounds": [{"outputs": [[ids...]], "num_cached_tokens": [n...], "served": {...},
       "metrics": {...}}]}
"""

from __future__ import annotations

import json
import os
import sys

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
    return out


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    kw = {}
    if spec.get("extra_config") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "TieredKVConnector",
            "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["extra_config"],
        }
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=4096, enforce_eager=True, seed=0,
              block_size=spec.get("block_size", 32), enable_prefix_caching=True, max_num_seqs=8,
              max_num_batched_tokens=4096, **kw)
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    conn = _connector(llm)
    rounds = []
    for r in spec.get("rounds", [{}]):
        if r.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        if conn is not None and conn.worker is not None:
            conn.worker.served.clear()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        rounds.append({
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
            "served": dict(conn.worker.served) if conn is not None and conn.worker is not None else {},
            "metrics": _snapshot(conn),
        })
    with open(out_path, "w") as f:
        json.dump({"rounds": rounds}, f)
    if conn is not None:
        conn.shutdown()  # drain offloads and close the tiers before the process exits


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
