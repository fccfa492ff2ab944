"""``dtkv bench <path>``: each benchmark is a module ``dynamo_tiered_kv/bench/<path>.py``, or a
package ``dynamo_tiered_kv/bench/<path>/`` whose ``__init__`` exposes them, with
``add_arguments(parser)`` and ``run(args) -> dict``. ``--json`` prints that dict and nothing else
on stdout (``--json FILE`` writes it to FILE instead); otherwise the module's
``format_result(result)`` tables (``bench/report.py``) are printed. Progress goes to stderr
(``--no-progress`` silences it)."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
from types import ModuleType
from typing import Any

from .. import bench
from ..bench import report
from ._deferred import defer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: each data path against its raw ceiling in the same run")
    defer(p, _add_benches)  # importing every bench module costs seconds (torch): only for `dtkv bench`


def _add_benches(p: argparse.ArgumentParser) -> None:
    paths = p.add_subparsers(dest="bench_path", required=True)
    for mod in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        m = importlib.import_module(f"{bench.__name__}.{mod.name}")
        if not callable(getattr(m, "run", None)):  # helpers (report.py, engine/; a submodule named run is no bench)
            continue
        bp = paths.add_parser(mod.name, help=(m.__doc__ or "").strip().splitlines()[0])
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
