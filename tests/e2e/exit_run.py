"""One in-process engine run that ends without any shutdown call: ``python exit_run.py SPEC.json OUT.json``.

SPEC: {"model": dir, "extra_config": {...}, "prompt": [ids...], "block_size": n, "chunk": n}
OUT:  {"num_cached_tokens": n}. The process then just returns from ``main``: whatever the store
keeps is what its exit hook saved (``dynamo_tiered_kv.store.lifecycle``).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=4096, enforce_eager=True, seed=0,
              block_size=spec["block_size"], enable_prefix_caching=True, max_num_seqs=4,
              max_num_batched_tokens=spec["chunk"], enable_chunked_prefill=True,
              kv_transfer_config={"kv_connector": "TieredKVConnector",
                                  "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
                                  "kv_role": "kv_both", "kv_connector_extra_config": spec["extra_config"]})
    out = llm.generate([{"prompt_token_ids": spec["prompt"]}], SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump({"num_cached_tokens": int(out[0].num_cached_tokens or 0)}, f)
    # no llm shutdown, no store close: a batch job's ordinary end


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
