# shellcheck shell=bash
# The Python environment of the GPU scripts, sourced from the repository root by scripts/gpu-check
# and scripts/gpu-probe/run.sh; `gpu_env` needs PY (the interpreter). It installs .gpu-wheels/
# (fetched by scripts/gpu-wheels) into .gpu-site/ and puts .gpu-site/ and the checkout on
# PYTHONPATH, and the directory holding libcufile (NVIDIA's cuFile wheel) on LD_LIBRARY_PATH.
# Returns 2 when the wheels do not install. Once per process tree: a script run by another that
# set the environment up (DTKV_GPU_ENV is exported) leaves it as it is.
gpu_env() {
  [ -n "${DTKV_GPU_ENV:-}" ] && return 0
  if [ -d .gpu-wheels ]; then
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --upgrade --target .gpu-site .gpu-wheels/*.whl \
      || { echo "installing .gpu-wheels into .gpu-site failed"; return 2; }
    export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # NIXL's GDS plugin and the GDS probe load libcufile, which NVIDIA's cuFile wheel ships outside
  # any default library path: its directory goes on LD_LIBRARY_PATH (read by the loader at process start)
  local find_cufile dirs
  read -r -d '' find_cufile <<'PY'
import glob, os, sys
found = {os.path.dirname(p) for d in sys.path if d and os.path.isdir(os.path.join(d, "nvidia"))
         for p in glob.glob(os.path.join(d, "nvidia", "**", "libcufile.so*"), recursive=True)}
print(":".join(sorted(found)))
PY
  dirs=$(timeout 60 "$PY" -c "$find_cufile" 2>/dev/null)
  [ -n "$dirs" ] && export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export DTKV_GPU_ENV=1
  return 0
}
