"""Abort a request while its asynchronous restore runs, on a real vLLM CPU engine (in-process):
``python abort_run.py MODEL_DIR ROOT OUT.json``. The restore is held on a gate; vLLM must keep
the request's blocks until the restore returned, then free them, and the engine keeps serving."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")


def main(model: str, root: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import RequestStatus

    from dynamo_tiered_kv.bench.engine.tiny_model import synthetic_tokens

    # sync_restore_max_tokens 0: this small restore on an idle engine would otherwise run synchronously
    cfg = {"host_capacity_bytes": 256 << 20, "metrics_port": None, "sync_restore_max_tokens": 0}
    llm = LLM(model=model, dtype="bfloat16", max_model_len=4096, enforce_eager=True, seed=0, block_size=32,
              enable_prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=4096,
              kv_transfer_config={"kv_connector": "TieredKVConnector",
                                  "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
                                  "kv_role": "kv_both", "kv_connector_extra_config": cfg})
    sp = SamplingParams(max_tokens=8, temperature=0)
    prompt = {"prompt_token_ids": synthetic_tokens(600, 5)}
    stored = list(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)
    worker = get_kv_transfer_group().worker
    worker.store.drain(60)
    gate, log = threading.Event(), []
    orig = worker.store.load

    def gated(*a, **k):
        gate.wait(60)
        r = orig(*a, **k)
        log.append(("load_returned", time.monotonic()))
        return r

    worker.store.load = gated
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    llm.reset_prefix_cache()
    free0 = pool.get_num_free_blocks()
    eng.add_request("p", prompt, sp)
    for _ in range(50):  # until vLLM parked it waiting for the restore
        eng.step()
        waiting = [r for r in sched.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        if waiting:
            break
    (req,) = waiting
    eng.abort_request(["p"])
    held = []
    for _ in range(20):  # the restore is still running: its blocks must stay allocated
        eng.step()
        held.append(req.request_id in sched.requests and pool.get_num_free_blocks() < free0)
        time.sleep(0.01)
    gate.set()
    deadline = time.monotonic() + 60
    while req.request_id in sched.requests and time.monotonic() < deadline:
        eng.step()
        time.sleep(0.005)
    log.append(("freed", time.monotonic()))
    free_after = pool.get_num_free_blocks()
    worker.store.load = orig
    again = list(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)
    with open(out_path, "w") as f:
        json.dump({"held": held, "log": [k for k, _ in sorted(log, key=lambda e: e[1])], "free0": free0,
                   "free_after": free_after, "stored": stored, "again": again}, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
