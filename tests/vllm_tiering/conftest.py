"""Tests of the vLLM >= 0.33 secondary tier, run against vLLM 0.33's own code.

They need vLLM 0.33 first on ``sys.path`` (``.deps/vllm-0.33``, from .ci/install-vllm-tiering.sh);
scripts/test runs them in their own pytest invocation with it. Anywhere else (the main run, whose
``vllm`` is the CPU engine 0.32) this directory collects nothing.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _vllm_033() -> bool:
    try:
        major, minor = (int(x) for x in version("vllm").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (0, 33)


collect_ignore_glob = [] if _vllm_033() else ["test_*.py", "tiering_engine.py"]
