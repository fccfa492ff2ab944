"""End to end on vLLM with CUDA: store in one engine process, restore in a fresh one.

The CPU e2e (``test_vllm_e2e.py``) compares a restore with a full recompute; on CUDA a prefix
hit runs different attention kernels than a full prefill, so the reference here is the engine's
*own* prefix-cache result: process A computes the prompts (storing them through the connector),
then runs them again from vLLM's prefix cache. Process B starts empty (no host tier, no GPU
cache), restores the same blocks from the SSD tier and must produce exactly A's prefix-cache
tokens. Runs on the GPU workflow (.github/workflows/gpu.yml); skips without CUDA or without a
CUDA build of vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none on this machine)", allow_module_level=True)
if torch.version.cuda is None:
    pytest.skip("torch is a CPU build: the GPU e2e needs vLLM's CUDA build", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM (CUDA build) not installed")

from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model, synthetic_tokens  # noqa: E402

RUNNER = Path(__file__).with_name("engine_run.py")
BS = 16
PROMPTS = [synthetic_tokens(300, 1), synthetic_tokens(200, 2)]
EXPECT_CACHED = [(300 - 1) // BS * BS, (200 - 1) // BS * BS]  # whole blocks; the last token is computed
BLOCKS = sum(EXPECT_CACHED) // BS


def run_phase(root: Path, name: str, model: Path, cfg: dict, rounds: list[dict]) -> list[dict]:
    spec = {"model": str(model), "extra_config": cfg, "prompts": PROMPTS, "max_tokens": 16,
            "block_size": BS, "rounds": rounds}
    spec_path, out_path = root / f"{name}.spec.json", root / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"phase {name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out_path.read_text())["rounds"]


def test_restore_in_fresh_process_matches_engine_prefix_cache(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    cfg = {"host_capacity_bytes": 256 << 20, "ssd_dir": str(tmp_path / "ssd"), "ssd_capacity_bytes": 1 << 30,
           "ssd_segment_bytes": 8 << 20, "staging_slab_bytes": 4 << 20, "staging_slabs": 4}
    computed, prefix = run_phase(tmp_path, "store", model, cfg, rounds=[{"persist_s": 60}, {}])
    assert computed["num_cached_tokens"] == [0, 0]
    assert computed["metrics"]["offload_blocks_total"] >= BLOCKS
    assert prefix["num_cached_tokens"] == EXPECT_CACHED  # vLLM's own prefix cache served round 2
    assert prefix["metrics"].get("tier_hits_total{host}", 0) == 0  # ... not the connector

    (restored,) = run_phase(tmp_path, "restore", model, cfg, rounds=[{}])
    assert restored["num_cached_tokens"] == EXPECT_CACHED
    assert restored["metrics"].get("tier_hits_total{ssd}", 0) == BLOCKS
    assert restored["metrics"].get("checksum_failures_total", 0) == 0
    assert restored["outputs"] == prefix["outputs"]
