"""``dtkv tenants``: what each tenant holds, a tenant's id, and erasing a tenant.

* ``dtkv tenants [list] [TARGET] [--ssd DIR]``: bytes, blocks and retained blocks per tenant in a
  bucket (its manifests), and on a node's SSD directory (the records' headers), with each
  tenant's quota from the settings.
* ``dtkv tenants id NAME``: the tenant id of a tenant name (a request's ``cache_salt``), keyed by
  the deployment's ``tenant_salt`` (settings / ``DYN_TIERED_KV_TENANT_SALT``).
* ``dtkv tenants erase TENANT [TARGET]``: destroy the tenant's key (encryption), delete or
  rewrite every object holding its records, and leave the erasure marker every node applies to
  its host and SSD tiers at its next index refresh (docs/TENANTS.md). TENANT is a name,
  ``id:<16 hex>`` or ``default``.
* ``dtkv tenants rotate-keys [TARGET]``: re-wrap every tenant key in the bucket under the current
  key-encryption key version of ``encryption_keys`` (run it once every node holds the new version;
  then the old version may leave the key source; docs/ENCRYPTION.md).

Settings (endpoint, credentials, ``object_url``, ``tenant_salt``, quotas) are the connector's:
flags, ``DYN_TIERED_KV_*`` env vars, ``--config`` / ``DYN_TIERED_KV_CONFIG_FILE``.
Exit codes: 0 done, 1 some deletes failed, 2 cannot reach the store or bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from ..config import settings_cli
from ..errors import TierUnavailable
from ._targets import missing_local_root

T = TypeVar("T")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tenants", help="tenants: bytes held per tier, ids, erasure")
    p.add_argument("action", nargs="?", default="list", choices=["list", "id", "erase", "rotate-keys"],
                   help="list (default), id NAME, erase TENANT, rotate-keys")
    p.add_argument("args", nargs="*", help="id: NAME; erase: TENANT [TARGET]; list: [TARGET]")
    p.add_argument("--ssd", help="also count the records of this SSD directory (a node's ssd_dir)")
    p.add_argument("--dry-run", action="store_true", help="erase: report what would go, change nothing")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    settings_cli.add_arguments(p)
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"dtkv tenants: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from ..blocks.tenant import parse_tenant, tenant_hex

    settings = settings_cli.load(args)
    cfg = settings.config
    salt = cfg.tenant_salt.get_secret_value()
    if args.action == "id":
        if len(args.args) != 1:
            return _fail("usage: dtkv tenants id NAME")
        print(tenant_hex(parse_tenant(args.args[0], deployment_salt=salt)))
        return 0
    if args.action == "erase":
        if not 1 <= len(args.args) <= 2:
            return _fail("usage: dtkv tenants erase TENANT [TARGET]")
        try:
            tenant = parse_tenant(args.args[0], deployment_salt=salt)
        except ValueError as e:
            return _fail(str(e))
        target = args.args[1] if len(args.args) == 2 else cfg.object_url
        return _erase(tenant, target, settings, args)
    if args.action == "rotate-keys":
        if len(args.args) > 1:
            return _fail("usage: dtkv tenants rotate-keys [TARGET]")
        return _rotate(args.args[0] if args.args else cfg.object_url, settings, args)
    if len(args.args) > 1:
        return _fail("usage: dtkv tenants [list] [TARGET] [--ssd DIR]")
    return _list(args.args[0] if args.args else cfg.object_url, settings, args)


class _Unreachable(Exception):
    """The target cannot be used; the message is the one line to print."""


def _on_bucket(target: str, settings: Any, work: Callable[[Any], Awaitable[T]]) -> T:
    """``work(backend)`` on the opened bucket ``target``; ``_Unreachable`` for a bad or unreachable
    target."""
    from ..tiers.objectstore import backend_from_url, is_object_url

    if not is_object_url(target):
        raise _Unreachable("TARGET must be s3://bucket/prefix or file:///dir (or set object_url)")
    missing = missing_local_root(target)
    if missing:
        raise _Unreachable(missing)
    backend = backend_from_url(target, **settings.s3_kwargs())

    async def go() -> T:
        await backend.open()
        try:
            return await work(backend)
        finally:
            await backend.close()

    try:
        return asyncio.run(go())
    except (TierUnavailable, OSError) as e:
        raise _Unreachable(settings_cli.describe_s3_failure(target, settings, e)) from None


def _erase(tenant: bytes, target: str | None, settings: Any, args: argparse.Namespace) -> int:
    from ..tenants.keystore import KEY_PREFIX
    from ..tiers.objectstore.tenants import erase_tenant_objects

    if not target:
        return _fail("no TARGET and no object_url setting: nothing to erase from")

    async def erase(backend: Any) -> tuple[bool, Any]:
        key_gone = False if args.dry_run else await backend.delete(f"{KEY_PREFIX}{tenant.hex()}")
        return key_gone, await erase_tenant_objects(backend, tenant, dry_run=args.dry_run)

    try:
        key_gone, rep = _on_bucket(target, settings, erase)
    except _Unreachable as e:
        return _fail(str(e))
    cache_s = settings.config.encryption_key_cache_s
    bound = settings.config.object_refresh_s
    if args.json:
        print(json.dumps({**rep.to_dict(), "key_destroyed": key_gone, "dry_run": args.dry_run}, indent=2))
    else:
        verb = "would make" if args.dry_run else "made"
        print(f"tenant {rep.tenant}: {verb} {rep.records} records unreachable ({rep.deleted_manifests} manifests "
              f"deleted, {rep.rewritten_manifests} rewritten without them, {rep.deleted_data} data objects "
              f"deleted) in {', '.join(rep.namespaces) or 'no namespace'}; key "
              f"{'destroyed' if key_gone else 'not found (encryption off, or already erased)'}; {rep.errors} errors")
        if not args.dry_run:
            print(f"nodes drop the tenant's host and SSD blocks at their next index refresh (object_refresh_s "
                  f"{bound if bound else 'off: restart them'}) and stop opening its sealed records within "
                  f"encryption_key_cache_s ({cache_s:g}s)")
    return 1 if rep.errors else 0


def _rotate(target: str | None, settings: Any, args: argparse.Namespace) -> int:
    from ..blocks.tenant import tenant_hex
    from ..errors import ConfigError
    from ..factory import key_source
    from ..tenants.keystore import TenantKeyStore

    if not target:
        return _fail("no TARGET and no object_url setting: no key store to rotate")
    try:
        keks = key_source(settings.config)
    except ConfigError as e:
        return _fail(f"encryption_keys: {e}")
    try:
        rep = _on_bucket(target, settings, lambda backend: TenantKeyStore(backend, keks).rotate())
    except _Unreachable as e:
        return _fail(str(e))
    out = {"version": rep.version, "rewrapped": [tenant_hex(t) for t in rep.rewrapped],
           "already_current": [tenant_hex(t) for t in rep.already_current],
           "unreadable": [tenant_hex(t) for t in rep.unreadable]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"tenant keys now wrapped under {rep.version}: {len(rep.rewrapped)} re-wrapped, "
              f"{len(rep.already_current)} already current, {len(rep.unreadable)} unreadable by any held version")
    return 1 if rep.unreadable else 0


def _ssd_holdings(root: Path) -> dict[bytes, list[int]]:
    """tenant -> [bytes, blocks] of the records in an SSD directory's segments, from their headers
    (each header is checked; payloads are not read, so a listing costs one 4 KiB read per record).
    Records deleted since they were written still count until their segment is reclaimed."""
    from ..blocks.codec import ALIGN, MAGIC, decode_header
    from ..errors import RecordError

    out: dict[bytes, list[int]] = {}
    for seg in sorted(root.rglob("seg-*")):
        fd = os.open(seg, os.O_RDONLY)
        try:
            size, off = os.fstat(fd).st_size, 0
            while off + ALIGN <= size:
                head = os.pread(fd, ALIGN, off)
                try:
                    hdr = decode_header(head) if head[:8] == MAGIC else None
                except RecordError:
                    hdr = None
                if hdr is None or off + hdr.record_bytes > size:
                    off += ALIGN  # not a record here (footer, padding, damage): resync page by page
                    continue
                h = out.setdefault(hdr.tenant, [0, 0])
                h[0] += hdr.record_bytes
                h[1] += 1
                off += hdr.record_bytes
        finally:
            os.close(fd)
    return out


def _list(target: str | None, settings: Any, args: argparse.Namespace) -> int:
    from ..blocks.tenant import tenant_hex
    from ..factory import tenant_quotas
    from ..tiers.objectstore.tenants import tenant_holdings

    cfg = settings.config
    rows: dict[str, dict[str, Any]] = {}
    if target:
        try:
            held = _on_bucket(target, settings, tenant_holdings)
        except _Unreachable as e:
            return _fail(str(e))
        quotas = tenant_quotas(cfg, "object", cfg.object_capacity_bytes)
        for t, h in held.items():
            rows.setdefault(tenant_hex(t), {})["object"] = {
                "bytes": h.bytes, "blocks": h.blocks, "retained_blocks": h.retained_blocks,
                "quota_bytes": quotas.limit(t) if quotas else None}
    if args.ssd:
        root = Path(args.ssd)
        if not root.is_dir():
            return _fail(f"--ssd {root}: no such directory")
        quotas = tenant_quotas(cfg, "ssd", cfg.ssd_capacity_bytes)
        for t, (n, blocks) in _ssd_holdings(root).items():
            rows.setdefault(tenant_hex(t), {})["ssd"] = {
                "bytes": n, "blocks": blocks, "quota_bytes": quotas.limit(t) if quotas else None}
    if not target and not args.ssd:
        return _fail("nothing to list: give TARGET (or set object_url) and/or --ssd DIR")
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    print(f"{'tenant':16}  {'tier':6} {'GiB':>9} {'blocks':>10} {'retained':>9} {'quota GiB':>10}")
    for t in sorted(rows, key=lambda t: -sum(v["bytes"] for v in rows[t].values())):
        for tier, v in sorted(rows[t].items()):
            q = v.get("quota_bytes")
            print(f"{t:16}  {tier:6} {v['bytes'] / 2**30:9.3f} {v['blocks']:10d} {v.get('retained_blocks', '-')!s:>9} "
                  f"{'-' if q is None else f'{q / 2**30:.1f}':>10}")
    return 0
