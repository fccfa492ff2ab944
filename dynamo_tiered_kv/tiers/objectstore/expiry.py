"""Retention classes in the object tier: persisted in manifests, enforced in-process.

* A manifest written while some of its blocks are retained carries their ``(priority, expiry)``
  in its optional ``retain`` field (docs/FORMAT.md); any process that indexes the manifest
  takes them over (``adopt_retention``), so a retention outlives the process that set it, and
  ``gc`` keeps such a manifest past its TTL until its retained entries expire (at most
  ``MAX_RETAIN_S`` after it was created).
* Capacity eviction drops objects in rank order (``object_ranks``): objects holding only
  expired or ordinary blocks before those holding protected ones, oldest first among equals.
* ``expire_pass`` is the in-process GC: it stops serving blocks whose retention expired and
  objects past their TTL, byte-bounded per pass. A manifest left with no live block is deleted
  only if its own record says no node needs it (``gc.delete_if_over``): other nodes may hold
  it for a retention this node does not know. The data objects then follow ``gc``'s orphan
  rule (tombstone, grace period), so readers holding an old index still read whole records;
  the pass itself needs no CronJob.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...policy.retention import ANONYMOUS
from .backend import ObjectBackend
from .catalog import Catalog
from .gc import delete_if_over
from .index import ObjectTable
from .manifest import MAX_RETAIN_S

if TYPE_CHECKING:
    import asyncio

    from ...policy.retention import RetentionClasses


class ExpiringTier(Protocol):
    """What a pass needs of the object tier (``tier.ObjectTier``), named here so this module
    sits below the tier instead of importing it back."""

    _retention: RetentionClasses | None
    ttl_s: float | None
    backend: ObjectBackend
    _lock: asyncio.Lock
    _cat: Catalog

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> Any: ...

#: expired blocks taken off the retention table per step of a pass
_STEP = 256


def adopt_retention(cls: RetentionClasses | None, cat: Catalog) -> None:
    """Take over the retention classes read from manifests (local settings win), each as one
    claim of ``ANONYMOUS`` (a manifest keeps a block's effective class, not its holders)."""
    got = cat.take_retained()
    if cls is None:
        return
    for key, (prio, expiry) in got.items():
        if key in cls:
            continue
        loc = cat.index.get(key)
        if loc is not None:
            cls.set(key, prio, expiry, int(loc[2]), ANONYMOUS)


def object_ranks(cls: RetentionClasses | None, cat: Catalog) -> dict[int, int] | None:
    """Object id -> retention rank of its most protected live block (None: nothing retained)."""
    if cls is None or not len(cls):
        return None
    now = cls.clock()
    return cat.object_ranks((key, cls.priority(key, now)) for key, _ in cls.items())


def retain_field(cls: RetentionClasses | None, keys: list[bytes]) -> tuple[tuple[int, int, float | None], ...]:
    """The manifest ``retain`` field for entries ``keys``: the protected ones' classes."""
    if cls is None or not len(cls):
        return ()
    now = cls.clock()
    out = []
    for i, key in enumerate(keys):
        r = cls.get(key)
        if r is not None and cls.priority(key, now) > 0:
            out.append((i, r.priority, r.expiry))
    return tuple(out)


def retained_classes(cls: RetentionClasses | None) -> dict[bytes, tuple[int, float | None]]:
    """Key -> (priority, expiry) of the blocks ``cls`` protects now (for the index snapshot)."""
    if cls is None or not len(cls):
        return {}
    now = cls.clock()
    return {key: (r.priority, r.expiry) for key, r in cls.items() if cls.priority(key, now) > 0}


@dataclass
class ExpireReport:
    blocks: int = 0  # blocks no longer served (retention expired, or in an expired object)
    bytes: int = 0
    manifests: int = 0  # manifests given up: no live block left (deleted if their record says so)


async def expire_pass(tier: ExpiringTier, *, now: float | None = None, max_bytes: int = 1 << 30) -> ExpireReport:
    """One in-process GC pass over ``tier`` (module docstring); frees at most about ``max_bytes``."""
    cls = tier._retention
    rep = ExpireReport()
    now = (cls.clock() if cls is not None else time.time()) if now is None else now
    async with tier._lock:
        cat = tier._cat
        touched: set[int] = set()
        while cls is not None and rep.bytes < max_bytes:
            batch = cls.expired(now, _STEP)
            if not batch:
                break
            for key, _ in batch:
                old = cat.index.get(key)
                if old is None:
                    continue
                cat.exclude_key(key)  # not served again, not even after a refresh re-lists it
                touched.add(int(old[0]))
                rep.blocks += 1
                rep.bytes += int(old[2])
        if tier.ttl_s is not None and rep.bytes < max_bytes:
            rep.bytes += _expire_objects(tier, cat, now, max_bytes - rep.bytes, rep)
        v = cat.objs.view
        empty = [i for i in touched if v["live"][i] <= 0 and not v["flags"][i] & ObjectTable.GONE]
        names = [cat.manifest_name(i) for i in empty]
        cat.forget(empty)
    for n in names:  # the data follows gc's orphan rule
        tier._spawn(delete_if_over(tier.backend, n, ttl_s=tier.ttl_s, now=now))
    rep.manifests += len(names)
    return rep


def _expire_objects(tier: ExpiringTier, cat: Catalog, now: float, budget: int, rep: ExpireReport) -> int:
    """Forget objects past their TTL that hold no protected block; their manifests are deleted."""
    assert tier.ttl_s is not None
    v = cat.objs.view
    live = ((v["flags"] & ObjectTable.GONE) == 0) & (v["live"] > 0)
    # an object whose created_at is within MAX_RETAIN_S may hold a protected block: ask the ranks
    old = np.flatnonzero(live & (v["created"] + tier.ttl_s < now))
    if not len(old):
        return 0
    ranks = object_ranks(tier._retention, cat) or {}
    doomed: list[int] = []
    freed = 0
    for i in old[np.argsort(v["created"][old], kind="stable")]:
        i = int(i)
        if ranks.get(i, 0) > 0 and v["created"][i] + MAX_RETAIN_S >= now:
            continue
        doomed.append(i)
        freed += int(v["live"][i])
        if freed >= budget:
            break
    names = [cat.manifest_name(i) for i in doomed]
    cls = tier._retention
    if cls is not None and doomed:  # the tier drops these blocks: every holder's claim goes with them
        gone = set(doomed)
        cls.forget([k for k in cls.retained_keys() if (loc := cat.index.get(k)) is not None and int(loc[0]) in gone])
    cat.forget(doomed)
    for n in names:
        tier._spawn(delete_if_over(tier.backend, n, ttl_s=tier.ttl_s, now=now))
    rep.manifests += len(names)
    return freed
