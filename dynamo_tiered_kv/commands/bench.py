"""``dtkv bench <path>``: each benchmark is a module ``dynamo_tiered_kv/bench/<path>.py`` with
``add_arguments(parser)`` and ``run(args) -> dict``; results print as a table or ``--json``."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil

from .. import bench


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: each data path against its raw ceiling in the same run")
    paths = p.add_subparsers(dest="bench_path", required=True)
    for mod in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        m = importlib.import_module(f"{bench.__name__}.{mod.name}")
        bp = paths.add_parser(mod.name, help=(m.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        m.add_arguments(bp)
        bp.set_defaults(func=lambda a, m=m: _run(m, a))


def _run(module, args: argparse.Namespace) -> int:
    result = module.run(args)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(format_table(result))
    return 0


def format_table(result: dict) -> str:
    width = max((len(k) for k in result), default=0)
    lines = []
    for k, v in result.items():
        if isinstance(v, float):
            v = f"{v:.3f}"
        elif isinstance(v, (dict, list)):
            v = json.dumps(v)
        lines.append(f"{k:<{width}}  {v}")
    return "\n".join(lines)
