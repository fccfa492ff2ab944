"""``dtkv gc TARGET``: apply retention to an object store (``s3://bucket/prefix`` or ``file:///dir``).

Deletes manifests older than ``--ttl``; data objects no manifest references are tombstoned and
deleted by a later run once ``--grace`` has passed (readers that listed earlier keep working).
Settings (endpoint, credentials, ``object_url``, ``object_ttl_s``) are the connector's: flags,
``DYN_TIERED_KV_*`` env vars, ``--config`` / ``DYN_TIERED_KV_CONFIG_FILE``.
Exit codes: 0 done, 1 some deletes failed, 2 cannot reach the store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from typing import TYPE_CHECKING

from ..config import TieredKVConfig, settings_cli
from ..errors import TierUnavailable
from ._targets import missing_local_root

if TYPE_CHECKING:
    from ..tiers.objectstore.gc import GcReport

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"45s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 3600, 30m, 12h, 7d)")
    return float(m.group(1)) * _UNITS.get(m.group(2) or "s", 1)


class _DefaultTTL(float):
    """``--ttl`` not given: use the ``object_ttl_s`` setting (equal to its default, for callers
    that compare the parsed value with the config's default)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="garbage-collect an object store: expire old manifests, delete orphan data")
    p.add_argument("target", nargs="?",
                   help="s3://bucket/prefix or file:///dir (default: the object_url setting)")
    default_ttl = _DefaultTTL(TieredKVConfig.model_fields["object_ttl_s"].default)
    p.add_argument("--ttl", type=parse_duration, default=default_ttl,
                   help="manifest lifetime, e.g. 14d (default: the object_ttl_s setting)")
    p.add_argument("--no-ttl", action="store_true", help="expire nothing; only collect orphans")
    p.add_argument("--grace", type=parse_duration, default=parse_duration("1h"),
                   help="how long unreferenced data stays readable before deletion (default 1h)")
    p.add_argument("--endpoint", help="deprecated spelling of --s3-endpoint-url")
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    settings_cli.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..tiers.objectstore import backend_from_url, is_object_url
    from ..tiers.objectstore.gc import gc_bucket

    if args.endpoint and not args.s3_endpoint_url:
        args.s3_endpoint_url = args.endpoint
    settings = settings_cli.load(args)
    target = args.target or settings.config.object_url
    if not target or not is_object_url(target):
        print("dtkv gc: TARGET must be s3://bucket/prefix or file:///dir (or set object_url)", file=sys.stderr)
        return 2
    missing = missing_local_root(target)
    if missing:
        print(f"dtkv gc: {missing}", file=sys.stderr)
        return 2
    ttl = settings.config.object_ttl_s if isinstance(args.ttl, _DefaultTTL) else args.ttl

    async def go() -> GcReport:
        backend = backend_from_url(target, **settings.s3_kwargs())
        await backend.open()
        try:
            return await gc_bucket(backend, ttl_s=None if args.no_ttl else ttl, grace_s=args.grace,
                                    dry_run=args.dry_run)
        finally:
            await backend.close()

    try:
        rep = asyncio.run(go())
    except (TierUnavailable, OSError) as e:
        print(f"dtkv gc: {settings_cli.describe_s3_failure(target, settings, e)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{target}: {rep.manifests} manifests ({rep.expired_manifests} expired, {rep.bad_manifests} "
              f"unreadable), {rep.data_objects} data objects; {verb} {rep.deleted_data} "
              f"({rep.deleted_bytes / 2**20:.1f} MiB), {rep.tombstoned} entered grace, "
              f"{rep.aborted_uploads} stale uploads aborted, quarantine: {rep.quarantine_cleared} cleared, "
              f"{rep.quarantine_dropped} corrupt records dropped; {rep.errors} errors")
    return 1 if rep.errors else 0
