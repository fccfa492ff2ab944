#!/usr/bin/env bash
# The product as users install it: build the wheel from this checkout, install it into a fresh
# virtualenv with its runtime dependencies only (CPU torch first, then the wheel, no extras: no
# pytest, no moto), then run `dtkv --help`, every subcommand's and every benchmark's --help and
# `dtkv plan --preset seed`, and import every module of the package (.ci/plain_install_imports.py).
#   PYTHON               interpreter for the virtualenv (default: .venv's, else python3)
#   DTKV_SMOKE_EXTRAS    extras to install with the wheel, e.g. "nixl" (default none: ~430 MB)
#   DTKV_SMOKE_KEEP=1    keep the work directory (printed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
work=$(mktemp -d /tmp/dtkv-plain-install.XXXXXX)
[ "${DTKV_SMOKE_KEEP:-0}" = 1 ] && echo "plain-install: work directory $work" >&2 || trap 'rm -rf "$work"' EXIT
say() { echo "plain-install: $*" >&2; }
t0=$SECONDS

# the wheel, built as a user's `pip install .` would build it (setuptools from the index)
quiet() {  # "$@" with its output in a log, shown only when it fails (pip's index warnings are noise)
  "$@" >"$work/log" 2>&1 || { cat "$work/log" >&2; say "FAILED: $*"; exit 1; }
}
quiet "$PY" -m pip wheel --no-deps -w "$work/dist" .
wheel=$(ls "$work"/dist/dynamo_tiered_kv-*.whl)
# a virtualenv of its own: the base interpreter, not .venv's packages
base=$("$PY" -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$work/venv"
v="$work/venv/bin"
# --no-compile: byte-compiling all of torch costs minutes; what is imported compiles on import
quiet "$v/python" -m pip install --no-compile torch==2.13.0
say "torch installed ($((SECONDS - t0)) s)"
extras=${DTKV_SMOKE_EXTRAS:+[$DTKV_SMOKE_EXTRAS]}
quiet "$v/python" -m pip install --no-compile "${wheel}${extras}"
say "installed $(basename "$wheel")${extras} with runtime dependencies only ($((SECONDS - t0)) s)"

# none of the test extra may have come along: otherwise this proves nothing
leaked=$("$v/python" - <<'PY'
import importlib.util
print(" ".join(m for m in ("pytest", "hypothesis", "moto", "vllm", "sglang") if importlib.util.find_spec(m)))
PY
)
[ -z "$leaked" ] || { say "FAILED: the plain install has $leaked"; exit 1; }

cd "$work"  # away from the checkout: the installed package, not the source tree, is imported
"$v/dtkv" --help >/dev/null
"$v/dtkv" --version
# every subcommand's and benchmark's --help, in one process (each one a fresh `dtkv` would import
# torch again: minutes on a small machine); the console script itself ran above
"$v/python" - <<'PY'
import argparse
import contextlib
import io
import sys

from dynamo_tiered_kv.cli import build_parser, main


def choices(p: argparse.ArgumentParser) -> dict:
    getattr(p, "complete", lambda: None)()
    sub = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return sub[0].choices if sub else {}


paths = [[name, *([child] if child else [])] for name, p in choices(build_parser()).items()
         for child in [None, *choices(p)]]
for argv in paths:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    if "usage: dtkv " + " ".join(argv) not in out.getvalue():
        sys.exit(f"plain-install: FAILED: dtkv {' '.join(argv)} --help printed no usage")
print(f"plain-install: dtkv --help and {len(paths)} subcommand helps: OK", file=sys.stderr)
PY
"$v/dtkv" plan --preset seed >"$work/plan.txt"
grep -q "scenario seed" "$work/plan.txt" || { cat "$work/plan.txt" >&2; say "FAILED: dtkv plan --preset seed"; exit 1; }
say "dtkv plan --preset seed: OK"
"$v/python" "$OLDPWD/.ci/plain_install_imports.py"
say "done in $((SECONDS - t0)) s"
