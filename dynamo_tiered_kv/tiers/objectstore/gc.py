"""Retention and garbage collection for the object tier.

Rules (docs/OBJECTS.md):

1. A manifest whose ``created_at`` is older than ``ttl_s`` has expired: it is deleted first, so
   no node discovers its records any more. Retained entries (its optional ``retain`` field)
   extend its life to their expiry, at most ``MAX_RETAIN_S`` (30 days) after ``created_at``.
2. A data object that no manifest references is *not* deleted at once: nodes that listed the
   manifest earlier may still be reading it. GC writes a tombstone ``tombstones/<digest>``; its
   mtime starts the grace period. A later run deletes the data (then the tombstone) once the
   tombstone is older than ``grace_s`` and the data is still unreferenced. A node that reads a
   deleted data object gets a miss (404), never wrong bytes.
3. A tombstone whose data became referenced again (another node re-published the same content)
   is removed. Manifests are re-listed right before data is deleted, and each object is deleted
   only if its tombstone still exists: a publisher that finds the data already there deletes
   the tombstone before writing its manifest (and re-checks the data after; ``tier.py``).
4. Unfinished multipart uploads (and local temp files) older than ``grace_s`` are aborted.
5. Unreadable manifests are kept for ``grace_s`` (they may be mid-replace on an odd server),
   then deleted; their data then follows rule 2.
6. Quarantine markers (``quarantine.py``) are resolved first: a record that verifies again is
   cleared, one that fails twice more is dropped from the manifests listing it.

A node's own expiry pass (``expiry.py``) deletes a shared manifest only through
``delete_if_over``: when the manifest's own record says no node needs it any more (rule 1, or
every entry retained in it with every retention over), never because of what one node alone
holds in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass

from ...errors import TierUnavailable
from .backend import ObjectBackend
from .manifest import DATA_DIR, MANIFEST_DIR, TOMBSTONE_DIR, Manifest, ManifestError, digest_of, tombstone_name
from .quarantine import resolve_quarantine

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0


@dataclass
class GcReport:
    manifests: int = 0
    data_objects: int = 0
    expired_manifests: int = 0
    bad_manifests: int = 0
    tombstoned: int = 0  # data objects that entered their grace period in this run
    deleted_data: int = 0
    deleted_bytes: int = 0
    resurrected: int = 0  # tombstones dropped because the data is referenced again
    aborted_uploads: int = 0
    spared: int = 0  # ripe data kept because a publisher cleared its tombstone meanwhile
    quarantine_cleared: int = 0  # markers whose record verified again (or is no longer listed)
    quarantine_dropped: int = 0  # records confirmed corrupt and removed from their manifests
    errors: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict[str, int | bool]:
        return asdict(self)


def manifest_over(m: Manifest, ttl_s: float | None, now: float) -> bool:
    """Whether ``m``'s own record says no node needs it at ``now``: it is past its TTL as extended
    by its retained entries (rule 1), or it was kept for retained entries only (every entry has
    a ``retain`` class) and every one of those retentions is over. A retention one node keeps in
    memory only (a ``kv.retain`` no manifest records) does not count: other nodes cannot see it."""
    end = m.keep_until(ttl_s)
    if end is not None and end < now:
        return True
    retained = {i for i, _, _ in m.retain}
    return (bool(m.entries) and retained == set(range(len(m.entries)))
            and all(x is not None and x <= now for _, _, x in m.retain))


async def delete_if_over(backend: ObjectBackend, name: str, *, ttl_s: float | None, now: float) -> bool:
    """Delete manifest ``name`` if ``manifest_over`` holds for what the bucket stores under it (one
    GET first). A manifest that vanished or cannot be read is left to ``gc_objects``. Returns
    whether it was deleted.

    Raises:
        TierUnavailable: the store failed (the manifest stays; a later pass or gc decides again).
    """
    raw = await backend.get_bytes(name)
    if raw is None:
        return False
    try:
        m = Manifest.from_bytes(raw)
    except ManifestError:
        return False
    if not manifest_over(m, ttl_s, now):
        log.debug("keeping manifest %s: its record still retains blocks", name)
        return False
    return await backend.delete(name)


async def gc_objects(backend: ObjectBackend, *, ttl_s: float | None, grace_s: float = DEFAULT_GRACE_S,
                     now: float | None = None, dry_run: bool = False, concurrency: int = 16) -> GcReport:
    """Apply retention to the objects of ``backend`` (opened by the caller).

    Args:
        ttl_s: manifest lifetime; None expires nothing (only orphans are collected).
        grace_s: how long unreferenced data stays readable before deletion.
        now: unix time to judge ages against (tests); defaults to ``time.time()``.
        dry_run: report what would be done without changing anything.

    Raises:
        TierUnavailable: the store could not be listed (a failed delete is only counted).
    """
    now = time.time() if now is None else now
    rep = GcReport(dry_run=dry_run)
    sem = asyncio.Semaphore(concurrency)

    async def guarded(coro) -> object:
        async with sem:
            try:
                return await coro
            except TierUnavailable as e:
                rep.errors += 1
                log.warning("gc: %s", e)
                return None

    q = await resolve_quarantine(backend, dry_run=dry_run)  # rule 6, before manifests are read
    rep.quarantine_cleared, rep.quarantine_dropped, rep.errors = q.cleared, q.dropped, q.errors
    manifests = await backend.list(MANIFEST_DIR)
    rep.manifests = len(manifests)
    raws = await asyncio.gather(*(guarded(backend.get_bytes(m.name)) for m in manifests))
    referenced: set[str] = set()
    doomed: list[str] = []
    for info, raw in zip(manifests, raws):
        if raw is None:
            continue  # vanished meanwhile, or a read error (counted)
        try:
            m = Manifest.from_bytes(raw)  # type: ignore[arg-type]
        except ManifestError as e:
            rep.bad_manifests += 1
            if now - info.mtime > grace_s:
                log.warning("gc: deleting unreadable manifest %s: %s", info.name, e)
                doomed.append(info.name)
            continue
        end = m.keep_until(ttl_s)  # retained entries extend the TTL (optional ``retain`` field)
        if end is not None and end < now:
            rep.expired_manifests += 1
            doomed.append(info.name)
        else:
            referenced.add(m.data)
    if not dry_run:  # rule 1: manifests go first
        await asyncio.gather(*(guarded(backend.delete(n)) for n in doomed))

    data = await backend.list(DATA_DIR)
    rep.data_objects = len(data)
    tombs = {digest_of(t.name): t for t in await backend.list(TOMBSTONE_DIR)}
    ripe, fresh = [], []
    for d in data:
        if d.name in referenced:
            continue
        t = tombs.get(digest_of(d.name))
        if t is None:
            fresh.append(d)
        elif now - t.mtime >= grace_s:
            ripe.append(d)
    if not dry_run:
        await asyncio.gather(*(guarded(backend.put_object(tombstone_name(d.name), b"gc", if_absent=True))
                               for d in fresh))
        if grace_s <= 0:
            ripe += fresh  # no grace: delete in this same run
    rep.tombstoned = len(fresh)
    if ripe:
        # Rule 3: someone may have re-published one of these meanwhile.
        again = await backend.list(MANIFEST_DIR)
        new = [m.name for m in again if m.name not in {x.name for x in manifests}]
        for raw in await asyncio.gather(*(guarded(backend.get_bytes(n)) for n in new)):
            if raw:
                with contextlib.suppress(ManifestError):
                    referenced.add(Manifest.from_bytes(raw).data)  # type: ignore[arg-type]
        ripe = [d for d in ripe if d.name not in referenced]
        if not dry_run:
            async def delete_if_tombstoned(name: str) -> bool | None:
                if await backend.head(tombstone_name(name)) is None:
                    rep.spared += 1  # re-published after our listings (the tombstone was cleared)
                    return None
                return await backend.delete(name)

            results = await asyncio.gather(*(guarded(delete_if_tombstoned(d.name)) for d in ripe))
            await asyncio.gather(*(guarded(backend.delete(tombstone_name(d.name))) for d in ripe))
            rep.deleted_data = sum(1 for r in results if r)
            rep.deleted_bytes = sum(d.size for d, r in zip(ripe, results) if r)
        else:
            rep.deleted_data = len(ripe)
            rep.deleted_bytes = sum(d.size for d in ripe)
    live_digests = {digest_of(n) for n in referenced}
    stale_tombs = [t.name for dg, t in tombs.items() if dg in live_digests]
    present = {digest_of(d.name) for d in data}
    stale_tombs += [t.name for dg, t in tombs.items() if dg not in present and now - t.mtime >= grace_s]
    rep.resurrected = sum(1 for dg in tombs if dg in live_digests)
    if not dry_run:
        await asyncio.gather(*(guarded(backend.delete(n)) for n in stale_tombs))
        rep.aborted_uploads = await guarded(backend.abort_incomplete(grace_s)) or 0  # type: ignore[assignment]
    return rep


async def gc_bucket(backend: ObjectBackend, *, ttl_s: float | None, grace_s: float = DEFAULT_GRACE_S,
                    now: float | None = None, dry_run: bool = False, snapshots: bool = True) -> GcReport:
    """``gc_objects`` over the legacy root layout and every ``ns/<hex>/`` namespace, then a fresh
    index snapshot per namespace (so the next node start costs one GET). Reports are summed."""
    from .layout import NamespaceView, list_namespaces, ns_prefix
    from .snapshotter import write_namespace_snapshot

    total = await gc_objects(backend, ttl_s=ttl_s, grace_s=grace_s, now=now, dry_run=dry_run)
    for ns in await list_namespaces(backend):
        view = NamespaceView(backend, ns_prefix(bytes.fromhex(ns)))
        rep = await gc_objects(view, ttl_s=ttl_s, grace_s=grace_s, now=now, dry_run=dry_run)
        for f, v in rep.to_dict().items():
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(total, f, getattr(total, f) + v)
        if snapshots and not dry_run:
            try:
                await write_namespace_snapshot(view, ttl_s=ttl_s)
            except TierUnavailable as e:
                total.errors += 1
                log.warning("gc: snapshot of %s: %s", view.url, e)
    return total
