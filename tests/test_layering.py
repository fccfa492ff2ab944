"""The package's layers, read from the source (``ast``, nothing imported):

* no product module imports ``dynamo_tiered_kv.testing`` or a test tool (pytest, hypothesis,
  moto): a plain ``pip install dynamo-tiered-kv`` has none of them;
* engine adapters (``connectors``) reach tiers only through ``factory`` / ``TieredStore``;
* the store and the tiers know no engine (nothing below ``cli``/``commands``/``bench`` imports
  ``connectors``);
* codec, keys and layout know no medium (no ``tiers``, no store);
* no import cycles among product modules: none at run time; counting imports made only for type
  annotations (``if TYPE_CHECKING:``), only the known ones below.

Every import counts, also one inside a function: a lazy import still runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "dynamo_tiered_kv"
TEST_TOOLS = {"pytest", "_pytest", "hypothesis", "moto"}
# Engine-free: what sits below the engine adapters and the command line.
ENGINE_FREE_EXCEPT = ("connectors", "commands", "cli", "bench", "testing", "__main__")
MEDIUM_FREE = ("codec", "keys", "layout")
STORE = ("store", "store_reads", "store_writes", "store_retention", "restore_stages", "lifecycle", "factory", "flush",
         "staging", "policy", "residency")
# Cycles that exist only through annotation imports (``if TYPE_CHECKING:``) are refused too: a type
# shared by two modules belongs below both. None is known.
KNOWN_TYPING_CYCLES: list[set[str]] = []


def module_files(root: Path = ROOT, pkg: str = PKG) -> dict[str, Path]:
    out = {}
    for f in sorted((root / pkg).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _typing_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported(name: str, path: Path, modules: set[str], *, typing: bool) -> set[str]:
    """Absolute names ``name`` imports: a product module where the import names one (``from . import
    io`` is the module ``io``, not its package), else the imported module's dotted name."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()

    def walk(nodes: list[ast.stmt]) -> Iterator[ast.stmt]:
        for n in nodes:
            if isinstance(n, ast.If) and _typing_only(n) and not typing:
                yield from walk(n.orelse)
                continue
            yield n
            for child in ast.iter_child_nodes(n):
                if isinstance(child, ast.stmt):
                    yield from walk([child])
                elif isinstance(child, ast.excepthandler):
                    yield from walk(child.body)

    for n in walk(ast.parse(path.read_text(), str(path)).body):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            mod = ".".join([*base[: len(base) - n.level + 1], n.module or ""]).strip(".") if n.level else n.module
            subs = {f"{mod}.{a.name}" for a in n.names} & modules
            out |= subs
            if len(subs) < len(n.names):
                out.add(mod)
    return out


def graph(*, typing: bool, root: Path = ROOT, pkg: str = PKG) -> dict[str, set[str]]:
    files = module_files(root, pkg)
    return {m: imported(m, f, set(files), typing=typing) - {m} for m, f in files.items()}


def cycles(g: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v] & set(g)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while (w := stack.pop()) != v:
                comp.add(w)
            if comp:
                out.append(comp | {v})

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(g.items()):
        layer = _layer(m)
        if layer == "testing":
            continue
        for d in sorted(deps):
            top, dl = d.split(".")[0], _layer(d)
            if top in TEST_TOOLS or (top == PKG and dl == "testing"):
                bad.append(f"{m} -> {d}: product code imports test support")
            elif layer == "connectors" and dl == "tiers":
                bad.append(f"{m} -> {d}: engine adapters reach tiers only through factory/TieredStore")
            elif layer not in ENGINE_FREE_EXCEPT and dl == "connectors":
                bad.append(f"{m} -> {d}: below the engine adapters nothing knows an engine")
            elif layer in MEDIUM_FREE and (dl == "tiers" or dl in STORE):
                bad.append(f"{m} -> {d}: codec/keys/layout know no medium")
    return bad


def test_no_forbidden_import() -> None:
    assert violations(graph(typing=True)) == []


def test_no_import_cycle_at_run_time() -> None:
    assert cycles(graph(typing=False)) == []


def test_no_new_import_cycle_through_annotations() -> None:
    assert [c for c in cycles(graph(typing=True)) if c not in KNOWN_TYPING_CYCLES] == []


def test_checks_catch_a_bad_arrow_and_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / PKG
    for rel, text in {
        "__init__.py": "", "testing/__init__.py": "import pytest\n", "tiers/__init__.py": "",
        "bench/s3.py": "from ..testing import make_record\n",
        "connectors/vllm.py": "def f():\n    from dynamo_tiered_kv.tiers import host\n", "tiers/host.py": "",
        "tiers/base.py": "from ..connectors import vllm\n",
        "codec.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .tiers import base\n",
        "a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    g = graph(typing=True, root=tmp_path)
    assert [v.split(":")[0] for v in violations(g)] == [
        "dynamo_tiered_kv.bench.s3 -> dynamo_tiered_kv.testing",
        "dynamo_tiered_kv.codec -> dynamo_tiered_kv.tiers.base",
        "dynamo_tiered_kv.connectors.vllm -> dynamo_tiered_kv.tiers.host",
        "dynamo_tiered_kv.tiers.base -> dynamo_tiered_kv.connectors.vllm",
    ]
    assert cycles(graph(typing=False, root=tmp_path)) == [{"dynamo_tiered_kv.a", "dynamo_tiered_kv.b"}]


def test_testing_package_imports_without_test_tools() -> None:
    """Record helpers work in a plain install; only the conformance suite needs pytest."""
    code = ("import sys; import dynamo_tiered_kv.testing as t, dynamo_tiered_kv.testing.ssd; "
            "t.make_record(t.random_key(1)); "
            "print(sorted({'pytest', 'hypothesis', 'moto'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
