#!/usr/bin/env bash
# The GPU probe (docs/GPU.md): on a machine with an NVIDIA GPU, from the repository root,
#
#   bash scripts/gpu-probe/run.sh [WORK_DIR [--cpu]]   # OUT=<dir> keeps probe-env.txt and probe.txt
#
# measures what the GPU path is built to do, each line with what the code predicts: the engine
# thread's part of a save with a forward queued, restore GB/s against a plain pinned copy, one
# load's chunks with the engine idle and busy, the Triton mover, GPUDirect Storage against cuFile's
# default config. scripts/gpu-check runs it as its last step; this runs it alone (under 8 minutes:
# every step has a time limit). With .gpu-wheels/ in the checkout (scripts/gpu-wheels) the wheels
# are installed as gpu-check installs them (scripts/gpu-env.sh).
#
#   WORK_DIR  where the probe writes (default .gpu-site/probe): on the disk under test, never tmpfs
#   --cpu     (after WORK_DIR) the probe's dry run: every call on CPU tensors, no timing means anything
#   PYTHON    the interpreter (default python3)
#   OUT       where the outputs go (default: a new temporary directory)
#
# Exit status: 0 the probe ran every section (it measures, it does not judge); 1 it could not
# import, a section raised, or it ran out of time (the output says which); 2 no CUDA device, the
# wheels did not install, or WORK_DIR is not usable.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
W=${1:-$PWD/.gpu-site/probe}
[ $# -gt 0 ] && shift  # the rest goes to probe.py
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT" "$W" || { echo "cannot create $OUT or $W"; exit 2; }
W=$(cd "$W" && pwd)
fstype=$(stat -f -c %T "$W" 2>/dev/null || echo unknown)
case "$fstype" in
  tmpfs|ramfs) echo "$W is on $fstype: give a directory on the disk under test (WORK_DIR argument)"; exit 2 ;;
esac
. scripts/gpu-env.sh
gpu_env || exit 2
rm -rf "$W/triton" "$W/gds"
export TRITON_CACHE_DIR="$W/triton"  # a fresh cache: the warm-up's compile time is measured, not a cache hit
glog='^(E|W)[0-9]{4} '  # NIXL's and cuFile's log lines

echo "=== probe environment ($(date +%T))"
{ if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi -L
    timeout 30 nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  else
    echo "nvidia-smi: not found"
  fi
  uname -r; df -T "$W" | tail -1; echo "nvidia-fs: $(ls /proc/driver/nvidia-fs 2>&1 | head -3 | tr '\n' ' ')"
  ls -l /etc/cufile.json 2>&1; echo "cores: $(nproc)"; free -g | head -2
  timeout 60 "$PY" - <<'PY' 2>&1 | grep -v -E "$glog"
import importlib.metadata as md

def ver(dist):
    try:
        return md.version(dist)
    except Exception:
        return None

print({d: ver(d) for d in ("torch", "triton", "numpy", "xxhash", "pydantic", "pytest", "nixl", "nvidia-cufile",
                           "nvidia-cufile-cu12")})
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    print("libcufile mapped after import torch:", "libcufile" in open("/proc/self/maps").read())
    from dynamo_tiered_kv.kernels import triton_available
    print("triton_available:", triton_available())
except Exception as e:
    print("torch or the package:", type(e).__name__, e)
try:
    import nixl._api as api
    agent = api.nixl_agent("probe-env", api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    print("NIXL plugins:", sorted(agent.plugin_list))
except Exception as e:
    print("NIXL:", type(e).__name__, e)
PY
} 2>&1 | tee "$OUT/probe-env.txt"

echo "=== probe in $W ($(date +%T))"
timeout 300 "$PY" scripts/gpu-probe/probe.py "$W" "$@" 2>&1 | grep --line-buffered -v -E "$glog" | tee "$OUT/probe.txt"
rc=${PIPESTATUS[0]}
case "$rc" in
  0) echo "probe: every section ran (outputs in $OUT)" ;;
  2) echo "probe: no CUDA device (outputs in $OUT)"; exit 2 ;;
  124|137) echo "probe: FAILED: out of time after 300 s (outputs in $OUT)"; exit 1 ;;
  *) echo "probe: FAILED: exit $rc: it could not import or a section raised (traceback above; outputs in $OUT)"
     exit 1 ;;
esac
