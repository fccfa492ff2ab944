"""``dtkv fsck TARGET``: verify every stored record; exit 1 and name what is corrupt.

TARGET is an SSD tier directory (its root or one ``rank-*`` directory). A URL target
(``s3://bucket/prefix``, ``file://...``) is handed to the object tier's checker,
``dynamo_tiered_kv.tiers.objectstore.fsck:fsck_objects(target, as_json=...) -> int``, when that
module exists. Exit codes: 0 clean (warnings allowed), 1 corruption found, 2 cannot check.
For SSD directories only a torn tail of a rank's newest segment is a warning; damage anywhere
else, including a truncated older segment, is corruption (rules: docs/SSD.md section 4).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsck", help="verify every record of an SSD tier directory (or an object-tier URL)")
    p.add_argument("target", help="SSD tier directory, or an object-tier URL such as s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if _URL.match(args.target):
        return _fsck_url(args.target, args.json)
    from ..tiers.ssd.fsck import fsck_dir

    path = Path(args.target)
    if not path.is_dir():
        print(f"dtkv fsck: {path} is not a directory", file=sys.stderr)
        return 2
    report = fsck_dir(path)
    if report.rank_dirs == 0:
        print(f"dtkv fsck: no SSD tier data under {path}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"{path}: {report.rank_dirs} rank dirs, {report.segments} segments ({report.sealed} sealed, "
              f"{report.unsealed} unsealed), {report.records_ok} records verified "
              f"({report.bytes_verified / 2**20:.1f} MiB), {report.tombstones} tombstones")
        for p in report.problems:
            where = p.segment + (f" @ offset {p.offset}" if p.offset is not None else "")
            key = f" key {p.key}" if p.key else ""
            print(f"{'CORRUPT' if p.corrupt else 'warning'}: {where}{key}: {p.error}")
        print(f"{len(report.corrupt)} corrupt" if report.corrupt else "clean")
    return 1 if report.corrupt else 0


def _fsck_url(target: str, as_json: bool) -> int:
    try:
        mod = importlib.import_module("dynamo_tiered_kv.tiers.objectstore.fsck")
        fn = mod.fsck_objects
    except (ImportError, AttributeError):
        print(f"dtkv fsck: no object-tier checker is installed for {target}", file=sys.stderr)
        return 2
    kwargs = {"as_json": as_json} if "as_json" in inspect.signature(fn).parameters else {}
    return int(fn(target, **kwargs))
