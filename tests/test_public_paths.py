"""The paths users and engines name stay importable: every ``dynamo_tiered_kv.*`` path the
documentation names, every ``python -m`` module it runs, the classes its engine configurations
name by module path (README's JSON), the ``dtkv`` console script, and every module path the
product itself starts a child process with or hands an engine as a string.

The vLLM 0.33 tier built from the README's entry is in tests/vllm_tiering/test_readme_tier_entry.py.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "dynamo_tiered_kv"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md",
        *sorted((ROOT / "deploy" / "helm").glob("*/README.md")), *sorted((ROOT / "examples").iterdir())]
_DOTTED = re.compile(r"\bdynamo_tiered_kv(?:\.[A-Za-z_]\w*)+")
_RUN = re.compile(r"python3? -m (dynamo_tiered_kv(?:\.\w+)*)")
_QUOTED_JSON = re.compile(r"'(\{.*?\})'")
# engines whose absence skips a path that needs them (a checkout without the engine extras)
ENGINES = {"vllm", "sglang"}


def _doc_text() -> str:
    return "\n".join(p.read_text() for p in DOCS if p.is_file())


def resolve(dotted: str) -> Any:
    """The module or attribute ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in ENGINES:
                pytest.skip(f"{dotted} needs {e.name}")
            spec = None
        if spec is None:
            continue
        try:
            obj: Any = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in ENGINES:
                pytest.skip(f"{dotted} needs {e.name}")
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def documented_paths() -> list[str]:
    return sorted(set(_DOTTED.findall(_doc_text())))


def documented_runs() -> list[str]:
    return sorted(set(_RUN.findall(_doc_text())))


def _named_classes(obj: Any) -> Iterator[tuple[str, str]]:
    """(module path, class name) pairs an engine configuration names."""
    if isinstance(obj, dict):
        if "kv_connector_module_path" in obj:
            yield obj["kv_connector_module_path"], obj["kv_connector"]
        if "module_path" in obj:
            yield obj["module_path"], obj.get("class_name") or obj["type"]
        for v in obj.values():
            yield from _named_classes(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _named_classes(v)


def readme_engine_classes() -> list[tuple[str, str]]:
    out = set()
    for m in _QUOTED_JSON.finditer((ROOT / "README.md").read_text()):
        out |= set(_named_classes(json.loads(m.group(1))))
    return sorted(out)


def product_module_strings() -> list[str]:
    """String constants in the product that are exactly a dotted path of ours (``-m`` children,
    engine ``module_path`` values, logger names)."""
    out = set()
    for f in (ROOT / PKG).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value):
                out.add(node.value)
    return sorted(out)


def test_the_scans_find_the_documented_paths() -> None:
    assert {"dynamo_tiered_kv.connectors.vllm", "dynamo_tiered_kv.connectors.vllm_tiering.connector",
            "dynamo_tiered_kv.connectors.sglang"} <= set(documented_paths())
    assert set(readme_engine_classes()) >= {
        ("dynamo_tiered_kv.connectors.vllm", "TieredKVConnector"),
        ("dynamo_tiered_kv.connectors.vllm_tiering", "DynamoTieredKVTier"),
        ("dynamo_tiered_kv.connectors.vllm_tiering.connector", "TieredOffloadingConnector"),
        ("dynamo_tiered_kv.connectors.sglang", "TieredHiCacheStorage"),
    }
    assert "dynamo_tiered_kv.commands.demo" in product_module_strings()


@pytest.mark.parametrize("dotted", documented_paths())
def test_documented_path_imports(dotted: str) -> None:
    assert resolve(dotted) is not None


@pytest.mark.parametrize("module", documented_runs())
def test_documented_python_m_module_exists(module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module


@pytest.mark.parametrize(("module", "name"), readme_engine_classes())
def test_readme_engine_config_names_a_class(module: str, name: str) -> None:
    assert isinstance(resolve(f"{module}.{name}"), type)


@pytest.mark.parametrize("dotted", product_module_strings())
def test_module_path_strings_in_the_product_exist(dotted: str) -> None:
    assert importlib.util.find_spec(dotted) is not None, dotted


def test_console_script_resolves() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"dtkv"}
    module, func = scripts["dtkv"].split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_top_level_public_surface() -> None:
    import dynamo_tiered_kv as pkg

    for name in pkg.__all__:
        assert getattr(pkg, name) is not None, name
    assert pkg.TieredStore is resolve("dynamo_tiered_kv.store.TieredStore")
    assert issubclass(pkg.ConfigError, pkg.TieredKVError)
