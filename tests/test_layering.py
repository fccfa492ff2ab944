"""The package's layers, read from the source (``ast``, nothing imported); docs/DESIGN.md draws
the same map. Layers are the packages below ``dynamo_tiered_kv``; the lists here name packages, and
the modules in them are found in the tree, so a module added to a package obeys its package's rules.

* no product module imports ``dynamo_tiered_kv.testing`` or a test tool (pytest, hypothesis,
  moto): a plain ``pip install dynamo-tiered-kv`` has none of them;
* ``testing`` never imports ``bench`` (benchmarks are not test support), but for the known arrows;
* engine adapters (``connectors``) reach tiers only through ``factory`` / ``TieredStore``; each
  adapter (``connectors.vllm``, ``.vllm_tiering``, ``.sglang``) imports no other adapter: what they
  share lives in ``connectors.common``;
* the store and the tiers know no engine (nothing below ``cli``/``commands``/``bench`` imports
  ``connectors``);
* the store reaches tiers through the contract (``tiers.base``) only: ``factory`` builds the
  concrete tiers (the known exceptions are listed below);
* ``hints`` knows no store and no tier: it turns a request's hints into claims, the store acts on
  them;
* ``blocks`` (keys, layout, the record codec) knows no medium and no store: it imports only
  itself, ``errors``, ``_native``, ``kernels`` and ``staging`` (the device copies and slabs its
  device path moves bytes through);
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
# What ``blocks`` may import (layers, i.e. packages or root modules of the package).
BLOCKS_MAY_IMPORT = {"blocks", "errors", "_native", "kernels", "staging"}
# Shared by the engine adapters; every other package under ``connectors`` is an adapter.
ADAPTERS_SHARED = "common"
# The tier contract; every other module under ``tiers`` is a concrete tier (or part of one).
TIER_CONTRACT = f"{PKG}.tiers.base"
# The store imports a concrete tier's module here. None: every tier is reached through ``Tier``.
KNOWN_STORE_TO_TIER: set[tuple[str, str]] = set()
# Test support built on bench code: deterministic keys, and SGLang's host pools (the module
# ``dtkv bench sglang`` builds them with, re-exported for the SGLang backend's tests).
KNOWN_TESTING_TO_BENCH = {(f"{PKG}.testing.records", f"{PKG}.bench._keys"),
                          (f"{PKG}.testing.sglang_host", f"{PKG}.bench.sglang.host")}
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


def _adapter(module: str) -> str:
    """The adapter a ``connectors`` module belongs to ("" for ``connectors`` itself and ``common``)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "connectors" or parts[2] == ADAPTERS_SHARED:
        return ""
    return parts[2]


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(g.items()):
        layer = _layer(m)
        for d in sorted(deps):
            top, dl = d.split(".")[0], _layer(d)
            if top != PKG and layer != "testing" and top in TEST_TOOLS:
                bad.append(f"{m} -> {d}: product code imports test support")
            elif top != PKG:
                continue
            elif dl == "testing" and layer != "testing":
                bad.append(f"{m} -> {d}: product code imports test support")
            elif layer == "testing" and dl == "bench" and (m, d) not in KNOWN_TESTING_TO_BENCH:
                bad.append(f"{m} -> {d}: test support imports no benchmark")
            elif layer == "connectors" and dl == "tiers":
                bad.append(f"{m} -> {d}: engine adapters reach tiers only through factory/TieredStore")
            elif _adapter(m) and _adapter(d) and _adapter(m) != _adapter(d):
                bad.append(f"{m} -> {d}: an engine adapter imports no other adapter (shared code: connectors.common)")
            elif layer not in ENGINE_FREE_EXCEPT and dl == "connectors":
                bad.append(f"{m} -> {d}: below the engine adapters nothing knows an engine")
            elif layer == "store" and dl == "tiers" and d != TIER_CONTRACT and (m, d) not in KNOWN_STORE_TO_TIER:
                bad.append(f"{m} -> {d}: the store reaches tiers through tiers.base; factory builds concrete tiers")
            elif layer == "hints" and dl in ("store", "tiers", "factory"):
                bad.append(f"{m} -> {d}: hints know no store and no tier")
            elif layer == "blocks" and dl not in BLOCKS_MAY_IMPORT:
                bad.append(f"{m} -> {d}: blocks know no medium and no store")
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
        "testing/records.py": "from ..bench import s3\n",
        "connectors/vllm/__init__.py": "def f():\n    from dynamo_tiered_kv.tiers import host\n",
        "connectors/sglang/backend.py": "from ..vllm import identity\n", "connectors/vllm/identity.py": "",
        "connectors/common/identity.py": "", "connectors/vllm_tiering/tier.py": "from ..common import identity\n",
        "tiers/host.py": "", "tiers/base.py": "from ..connectors import vllm\n",
        "store/store.py": "from ..tiers.base import Tier\nfrom ..tiers import host\n",
        "hints/plan.py": "from ..store import store\n",
        "blocks/codec.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..tiers import base\n",
        "a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    g = graph(typing=True, root=tmp_path)
    assert [v.split(":")[0] for v in violations(g)] == [
        "dynamo_tiered_kv.bench.s3 -> dynamo_tiered_kv.testing",
        "dynamo_tiered_kv.blocks.codec -> dynamo_tiered_kv.tiers.base",
        "dynamo_tiered_kv.connectors.sglang.backend -> dynamo_tiered_kv.connectors.vllm.identity",
        "dynamo_tiered_kv.connectors.vllm -> dynamo_tiered_kv.tiers.host",
        "dynamo_tiered_kv.hints.plan -> dynamo_tiered_kv.store.store",
        "dynamo_tiered_kv.store.store -> dynamo_tiered_kv.tiers.host",
        "dynamo_tiered_kv.testing.records -> dynamo_tiered_kv.bench.s3",
        "dynamo_tiered_kv.tiers.base -> dynamo_tiered_kv.connectors.vllm",
    ]
    assert cycles(graph(typing=False, root=tmp_path)) == [{"dynamo_tiered_kv.a", "dynamo_tiered_kv.b"}]


def test_the_known_exceptions_still_exist() -> None:
    """An exception that no longer exists is removed from its list (it would hide a new one)."""
    g = graph(typing=True)
    arrows = {(m, d) for m, deps in g.items() for d in deps}
    assert KNOWN_STORE_TO_TIER - arrows == set()
    assert KNOWN_TESTING_TO_BENCH - arrows == set()


def test_testing_package_imports_without_test_tools() -> None:
    """Record helpers work in a plain install; only the conformance suite needs pytest."""
    code = ("import sys; import dynamo_tiered_kv.testing as t, dynamo_tiered_kv.testing.ssd; "
            "t.make_record(t.random_key(1)); "
            "print(sorted({'pytest', 'hypothesis', 'moto'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
