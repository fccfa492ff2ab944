"""A bucket's tenants: what each holds, and erasing one (``dtkv tenants``; docs/TENANTS.md).

Manifests name each record's tenant (the optional ``tenants`` field; records written before it
are the default tenant's), so a listing reads manifests only, never data.

Erasing a tenant, per namespace (and the legacy root layout):

* a manifest whose records are all the tenant's is deleted, and so is its data object (unless
  another manifest still references it);
* a manifest that mixes tenants is rewritten: the other tenants' records are copied into a new,
  content-addressed data object with a new manifest, then the old manifest and data object go;
* each touched namespace's index snapshot is deleted (nodes then list manifests; the next
  ``dtkv gc`` writes a fresh one);
* a marker ``tenant-erasures/<tenant hex>.json`` records the time, so every node drops the
  tenant's blocks from its host and SSD tiers at its next index refresh (``ObjectTier.erasures``,
  ``store/erasure.py``) and erases its namespace once more (``ObjectTier.erase_tenant``): records
  a node flushed between the command and its refresh go too.

Readers that listed a manifest before it went get misses for its records (their GETs fail), never
another tenant's bytes. With encryption on, the command also destroys the tenant's key first
(``tenants.keystore``): every copy (backups, other nodes' SSDs) is unreadable from that moment.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...blocks.tenant import TENANT_BYTES
from ...errors import TierUnavailable
from ..segments import SegmentEntry
from .backend import ObjectBackend
from .layout import SNAPSHOT_NAME, NamespaceView, list_namespaces, ns_prefix
from .manifest import DATA_DIR, MANIFEST_DIR, Manifest, ManifestError, content_digest, data_name

log = logging.getLogger(__name__)

ERASURE_DIR = "tenant-erasures/"
MAX_MARKERS = 100_000  # markers read per refresh; more is an operator error, not a workload


@dataclass
class TenantHoldings:
    """What one tenant holds in a bucket."""

    bytes: int = 0
    blocks: int = 0
    retained_blocks: int = 0
    manifests: int = 0


@dataclass
class EraseReport:
    tenant: str
    records: int = 0  # the tenant's records made unreachable
    deleted_manifests: int = 0
    rewritten_manifests: int = 0  # mixed objects whose other records moved to a new object
    deleted_data: int = 0
    errors: int = 0
    namespaces: list[str] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list, repr=False)  # the records' keys (not reported)

    def to_dict(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "keys"}


def _views(backend: ObjectBackend, namespaces: Sequence[str]) -> list[ObjectBackend]:
    return [backend, *(NamespaceView(backend, ns_prefix(bytes.fromhex(ns))) for ns in namespaces)]


async def _manifests(view: ObjectBackend) -> list[tuple[str, Manifest]]:
    out: list[tuple[str, Manifest]] = []
    for info in await view.list(MANIFEST_DIR):
        raw = await view.get_bytes(info.name)
        if raw is None:
            continue  # deleted since the listing
        try:
            out.append((info.name, Manifest.from_bytes(raw)))
        except ManifestError as e:
            log.warning("%s: unreadable manifest %s: %s", view.url, info.name, e)
    return out


async def tenant_holdings(backend: ObjectBackend) -> dict[bytes, TenantHoldings]:
    """Bytes, blocks, retained blocks and manifests of every tenant in the bucket (all namespaces)."""
    out: dict[bytes, TenantHoldings] = {}
    for view in _views(backend, await list_namespaces(backend)):
        for _, m in await _manifests(view):
            retained = {i for i, _, _ in m.retain}
            seen: set[bytes] = set()
            for i, e in enumerate(m.entries):
                h = out.setdefault(e.tenant, TenantHoldings())
                h.bytes += e.length
                h.blocks += 1
                h.retained_blocks += i in retained
                if e.tenant not in seen:
                    seen.add(e.tenant)
                    h.manifests += 1
    return out


async def mark_erased(backend: ObjectBackend, tenant: bytes, at: float) -> None:
    body = json.dumps({"tenant": tenant.hex(), "erased_at": at}).encode()
    await backend.put_object(f"{ERASURE_DIR}{tenant.hex()}.json", body)


async def read_erasures(backend: ObjectBackend) -> dict[bytes, float]:
    """Every erasure marker in the bucket: tenant -> erase time (unreadable markers are skipped)."""
    out: dict[bytes, float] = {}
    for info in (await backend.list(ERASURE_DIR))[:MAX_MARKERS]:
        raw = await backend.get_bytes(info.name)
        try:
            doc = json.loads(raw or b"")
            tenant = bytes.fromhex(doc["tenant"])
            if len(tenant) == TENANT_BYTES:
                out[tenant] = float(doc["erased_at"])
        except (ValueError, KeyError, TypeError) as e:
            log.warning("unreadable tenant erasure marker %s: %s", info.name, e)
    return out


async def _rewrite(view: ObjectBackend, m: Manifest, keep: list[SegmentEntry]) -> Manifest:
    """A new data object and manifest holding only ``keep`` (records of ``m``'s data object)."""
    bufs = [bytearray(e.length) for e in keep]
    for e, b in zip(keep, bufs, strict=True):
        if await view.get_range(m.data, e.offset, [memoryview(b)]) is None:
            raise TierUnavailable(f"{m.data} is shorter than its manifest says")
    blob = b"".join(bufs)
    entries, pos = [], 0
    for e in keep:
        entries.append(SegmentEntry(e.key, pos, e.length, e.tenant))
        pos += e.length
    digest = content_digest(len(blob), entries, lambda o, n: blob[o:o + n])
    name = data_name(digest)
    await view.put_object(name, memoryview(blob), if_absent=True)
    kept = {e.key: i for i, e in enumerate(entries)}
    retain = tuple((kept[m.entries[i].key], p, x) for i, p, x in m.retain if m.entries[i].key in kept)
    new = Manifest(name, len(blob), m.created_at, tuple(entries), f"{m.origin} (tenant erased)", retain)
    await view.put_object(new.name, memoryview(new.to_bytes()))
    return new


async def erase_in_view(view: ObjectBackend, tenant: bytes, rep: EraseReport, *, dry_run: bool = False) -> bool:
    """Erase ``tenant``'s records from one namespace (or the root layout); True if any was there."""
    manifests = await _manifests(view)
    refs: dict[str, int] = {}
    for _, m in manifests:
        refs[m.data] = refs.get(m.data, 0) + 1
    touched = False
    for mname, m in manifests:
        theirs = [e for e in m.entries if e.tenant == tenant]
        if not theirs:
            continue
        touched = True
        rep.records += len(theirs)
        rep.keys += [e.key for e in theirs]
        if dry_run:
            continue
        keep = [e for e in m.entries if e.tenant != tenant]
        try:
            if keep:
                await _rewrite(view, m, keep)
                rep.rewritten_manifests += 1
            await view.delete(mname)
            rep.deleted_manifests += not keep
            refs[m.data] -= 1
            if refs[m.data] == 0 and m.data.startswith(DATA_DIR):
                await view.delete(m.data)
                rep.deleted_data += 1
        except (TierUnavailable, OSError) as e:
            rep.errors += 1
            log.warning("erasing tenant %s: %s in %s: %s", tenant.hex(), mname, view.url, e)
    if touched and not dry_run:
        await view.delete(SNAPSHOT_NAME)  # it names the old manifests
    return touched


async def erase_tenant_objects(backend: ObjectBackend, tenant: bytes, *, now: float | None = None,
                               dry_run: bool = False) -> EraseReport:
    """Make every record of ``tenant`` in the bucket unreachable and delete its bytes (module
    docstring). Idempotent: a rerun finds nothing left and rewrites the marker."""
    rep = EraseReport(tenant.hex())
    namespaces = await list_namespaces(backend)
    for ns, view in zip(["", *namespaces], _views(backend, namespaces), strict=True):
        if await erase_in_view(view, tenant, rep, dry_run=dry_run):
            rep.namespaces.append(ns or "(root)")
    if not dry_run:
        await mark_erased(backend, tenant, time.time() if now is None else now)
    return rep


async def erased_records_left(backend: ObjectBackend) -> dict[bytes, int]:
    """Records of erased tenants still listed in a manifest created before their erase (``dtkv
    fsck``: each is an error; records the tenant wrote after its erase are new data)."""
    erased = await read_erasures(backend)
    left: dict[bytes, int] = {}
    if not erased:
        return left
    for view in _views(backend, await list_namespaces(backend)):
        for _, m in await _manifests(view):
            for e in m.entries:
                at = erased.get(e.tenant)
                if at is not None and m.created_at <= at:
                    left[e.tenant] = left.get(e.tenant, 0) + 1
    return left
