"""``dtkv fsck TARGET``: verify every stored record; exit 1 and name what is corrupt.

TARGET is an SSD tier directory (its root or one ``rank-*`` directory) or an object-tier URL
(``s3://bucket/prefix``, ``file://...``), checked by ``tiers.objectstore.fsck.fsck_backend``;
without TARGET, the ``object_url`` setting, else ``ssd_dir``. S3 endpoint and credentials are the
connector's settings (flags, ``DYN_TIERED_KV_*`` env vars, ``--config`` / ``DYN_TIERED_KV_CONFIG_FILE``).
For SSD directories only a torn tail of a rank's newest segment is a warning; damage anywhere
else, including a truncated older segment, is corruption (rules: docs/SSD.md section 4).
Exit codes: ``EXIT_CODES`` below (shown by ``dtkv fsck --help``).
"""


from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import settings_cli
from ..errors import TierUnavailable
from ._targets import missing_local_root

if TYPE_CHECKING:
    from ..tiers.objectstore.fsck import FsckReport

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
EXIT_CODES = """exit codes:
  0  clean (warnings allowed)
  1  corruption found (each corrupt record is named)
  2  cannot check: bad arguments or settings, no such directory or no tier data, store unreachable
  3  internal error of dtkv fsck (a bug: --debug shows the traceback)"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsck", help="verify every record of an SSD tier directory (or an object-tier URL)",
                       description="Verify every stored record; name each corrupt one.", epilog=EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", help="SSD tier directory, or an object-tier URL such as s3://bucket/prefix "
                   "(default: the object_url setting, else ssd_dir)")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    settings_cli.add_arguments(p)
    p.set_defaults(func=run, internal_error_exit=3)  # 1 means corruption: a crash must not look like it


def run(args: argparse.Namespace) -> int:
    settings = settings_cli.load(args)
    target = args.target or settings.config.object_url or settings.config.ssd_dir
    if not target:
        print("dtkv fsck: give TARGET (or set object_url or ssd_dir)", file=sys.stderr)
        return 2
    target = str(target)
    if _URL.match(target):
        return _fsck_url(target, settings, args.json)
    from ..tiers.ssd.fsck import fsck_dir

    path = Path(target)
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


def _fsck_url(target: str, settings: settings_cli.Settings, as_json: bool) -> int:
    from ..tiers.objectstore.fsck import fsck_url

    missing = missing_local_root(target)
    if missing:
        print(f"dtkv fsck: {missing}", file=sys.stderr)
        return 2

    async def go() -> FsckReport:
        return await fsck_url(target, **settings.s3_kwargs())

    try:
        rep = asyncio.run(go())
    except (TierUnavailable, OSError) as e:
        print(f"dtkv fsck: {settings_cli.describe_s3_failure(target, settings, e)}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(rep.to_dict(), indent=2))
        return 1 if rep.problems else 0
    print(f"{target}: {rep.manifests} manifests, {rep.data_objects} data objects, {rep.records_ok} records "
          f"verified ({rep.bytes_verified / 2**20:.1f} MiB), {len(rep.orphans)} orphans")
    for o in rep.orphans:
        print(f"warning: orphan data object {o} (dtkv gc removes it after the grace period)")
    for q in rep.quarantined:
        print(f"warning: quarantined {q} (dtkv gc re-verifies and resolves it)")
    for p in rep.problems:
        where = p.object + (f" @ offset {p.offset}" if p.offset is not None else "")
        print(f"CORRUPT: {where}{' key ' + p.key if p.key else ''}: {p.error}")
    print(f"{len(rep.problems)} problems" if rep.problems else "clean")
    return 1 if rep.problems else 0
