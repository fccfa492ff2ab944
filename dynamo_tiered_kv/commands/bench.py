"""``dtkv bench <path>``: each benchmark is a module ``dynamo_tiered_kv/bench/<path>.py``, or a
package ``dynamo_tiered_kv/bench/<path>/`` whose ``__init__`` exposes them, with
``add_arguments(parser)`` and ``run(args) -> dict``. ``--json`` prints that dict and nothing else
on stdout (``--json FILE`` writes it to FILE instead); otherwise the module's
``format_result(result)`` tables (``bench/report.py``) are printed. Progress goes to stderr
(``--no-progress`` silences it).

Only the benchmark asked for is imported: the list of benchmarks and their one-line help come from
the source files (a module whose top level defines or imports ``run`` is a benchmark; its docstring's
first line is the help), so ``dtkv bench gpudirect`` starts where another bench's dependencies
(aiobotocore for the S3 benches, vLLM for the engine benches) are not installed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import bench
from ..bench import report
from ._deferred import DeferredParser, defer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: each data path against its raw ceiling in the same run")
    defer(p, _add_benches)  # the list of benches is read from source files: cheap, but only for `dtkv bench`


@dataclass(frozen=True)
class BenchSource:
    """A benchmark found in ``dynamo_tiered_kv/bench`` without importing it."""

    name: str
    help: str


def find_benches() -> list[BenchSource]:
    """Every benchmark under ``dynamo_tiered_kv/bench``, by name, read from source (nothing is imported).

    A module (or a package's ``__init__``) is a benchmark when its top level defines ``run`` or
    imports a name ``run``; helpers (``report.py``, ``engine/``, ``_keys.py``) are not."""
    found = []
    root = Path(bench.__path__[0])
    for mod in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        source = root / mod.name / "__init__.py" if mod.ispkg else root / f"{mod.name}.py"
        if not source.is_file():
            continue
        tree = ast.parse(source.read_text(), str(source))
        if "run" in _top_level_names(tree):
            doc = (ast.get_docstring(tree) or mod.name).strip().splitlines()
            found.append(BenchSource(mod.name, doc[0] if doc else mod.name))
    return found


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _add_benches(p: argparse.ArgumentParser) -> None:
    paths = p.add_subparsers(dest="bench_path", required=True, parser_class=DeferredParser)
    for b in find_benches():
        bp = paths.add_parser(b.name, help=b.help)
        defer(bp, lambda bp, name=b.name: _add_bench_arguments(bp, name))  # imports the bench on first use


def _add_bench_arguments(bp: argparse.ArgumentParser, name: str) -> None:
    """Import bench ``name`` (a failing import fails this bench only) and add its arguments."""
    m = importlib.import_module(f"{bench.__name__}.{name}")
    bp.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="print one JSON object (only that) instead of tables; with FILE: write it there "
                         "and print the tables")
    m.add_arguments(bp)
    if not any(a.dest == "no_progress" for a in bp._actions):
        bp.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    bp.set_defaults(func=lambda a, m=m: _run(m, a))


def _run(module: ModuleType, args: argparse.Namespace) -> int:
    report.set_progress(not args.no_progress)
    result = module.run(args)
    if args.json not in (None, "-"):  # a file: keep the result, show the tables
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True, default=str)
    if args.json == "-":
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    elif hasattr(module, "format_result"):
        print(module.format_result(result))
    else:
        print(format_table(result))
    return 0


def format_table(result: dict[str, Any]) -> str:
    """The fallback for a bench without ``format_result``: its scalar fields, one per line."""
    return report.key_values(result)
