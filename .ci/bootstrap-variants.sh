#!/usr/bin/env bash
# The documented bootstrap variants besides the default, each in a fresh copy of this checkout so a
# later install step cannot break one silently: SGLang only (DTKV_WITH_VLLM=0: no vLLM CPU engine,
# hence no vLLM 0.33 files either), then the SGLang backend's tests in that environment.
#   DTKV_VARIANTS_KEEP=1  keep the work directory (printed)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/dtkv-variants.XXXXXX)
[ "${DTKV_VARIANTS_KEEP:-0}" = 1 ] && echo "bootstrap-variants: work directory $work" >&2 || trap 'rm -rf "$work"' EXIT
say() { echo "bootstrap-variants: $*" >&2; }
t0=$SECONDS
# the tracked files as they are in the work tree (a clean clone in CI)
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$work"
(cd "$work" && DTKV_WITH_VLLM=0 bash scripts/bootstrap) || { say "FAILED: DTKV_WITH_VLLM=0 bash scripts/bootstrap"; exit 1; }
[ ! -d "$work/.deps/vllm-0.33" ] || { say "FAILED: DTKV_WITH_VLLM=0 still unpacked vLLM 0.33"; exit 1; }
(cd "$work" && .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_sglang_backend.py tests/test_sglang_layout.py) \
  || { say "FAILED: the SGLang backend's tests in the SGLang-only environment"; exit 1; }
say "SGLang-only bootstrap and its tests OK ($((SECONDS - t0)) s)"
