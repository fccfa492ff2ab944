"""Parent side of the engine benchmarks: the model, engine sessions in child processes, a progress bar."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .tiny_model import TinyModelSpec

BLOCK_SIZE = 64
#: Random-weight Llama shaped like Llama-3 in miniature so that prefill is not trivial on a 2-core
#: CPU: 6 layers, hidden 1024, MLP 4096, 16 query / 4 KV heads of 64 (GQA 4:1), 16k positions,
#: 91M parameters. KV per token: 6 layers * 2 (K, V) * 4 heads * 64 * 2 bytes = 6 KiB, so an 8k
#: context is 48 MiB. That is ~15k parameters per KV byte; Llama-3.1-8B has ~60k (128 KiB/token):
#: restore is relatively costlier here than on real models.
BENCH_SPEC = TinyModelSpec(vocab_size=2048, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                           max_position_embeddings=16384)


def kv_bytes_per_token(spec: TinyModelSpec = BENCH_SPEC) -> int:
    return spec.num_hidden_layers * 2 * spec.num_key_value_heads * spec.head_dim * 2


def model_desc(spec: TinyModelSpec = BENCH_SPEC) -> str:
    arch = "Qwen2 (q/k/v bias)" if spec.architecture == "qwen2" else "Llama"
    return (f"random-weight {arch}, {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, MLP "
            f"{spec.intermediate_size}, {spec.num_attention_heads} query / {spec.num_key_value_heads} KV heads "
            f"x {spec.head_dim}, vocab {spec.vocab_size}, bf16; KV {kv_bytes_per_token(spec)} B/token")


def run_session(spec: dict[str, Any], work: Path, name: str, bar: Any | None, offset: int,
                module: str = "dynamo_tiered_kv.bench.engine.session") -> dict[str, Any]:
    """Run one engine session (``module``, default ``engine.session``) in a fresh process; progress feeds ``bar``.

    Raises:
        RuntimeError: the session failed; the message carries the tail of its output.
    """
    spec_path, out_path, log_path = work / f"{name}.spec.json", work / f"{name}.out.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    # VLLM_CPU_KVCACHE_SPACE (GiB) sizes the allocation; num_gpu_blocks_override caps what is used
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [sys.executable, "-m", module, str(spec_path), str(out_path)]
    tail: collections.deque[str] = collections.deque(maxlen=60)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("@@dtkv "):
                if bar is not None:
                    bar.n = offset + json.loads(line[7:])["done"]
                    bar.refresh()
            else:
                tail.append(line)
        rc = proc.wait()
    if rc != 0 or not out_path.exists():
        err = "".join(tail) + log_path.read_text()[-4000:]
        raise RuntimeError(f"engine session {name} failed (exit {rc}); log {log_path}:\n{err}")
    return json.loads(out_path.read_text())


def s3_extra(endpoint: str, bucket: str, prefix: str) -> dict[str, Any]:
    """Connector settings for an S3 object tier at ``endpoint`` (bucket created if missing)."""
    env = os.environ
    ak, sk = env.get("DTKV_S3_ACCESS_KEY", "testing"), env.get("DTKV_S3_SECRET_KEY", "testing")
    region = env.get("DTKV_S3_REGION", "us-east-1")
    asyncio.run(_ensure_bucket(endpoint, bucket, ak, sk, region))
    return {"object_url": f"s3://{bucket}/{prefix}", "s3_endpoint_url": endpoint, "s3_access_key": ak,
            "s3_secret_key": sk, "s3_region": region}


async def _ensure_bucket(endpoint: str, bucket: str, ak: str, sk: str, region: str) -> None:
    from aiobotocore.session import get_session

    async with get_session().create_client("s3", endpoint_url=endpoint, aws_access_key_id=ak,
                                           aws_secret_access_key=sk, region_name=region) as c:
        try:
            await c.head_bucket(Bucket=bucket)
        except Exception:
            await c.create_bucket(Bucket=bucket)
