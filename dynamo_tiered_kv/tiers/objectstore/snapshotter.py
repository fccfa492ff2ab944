"""Build and publish a namespace's index snapshot from its manifests (``dtkv gc``, tools)."""

from __future__ import annotations

import asyncio
import time

from .backend import ObjectBackend
from .catalog import Catalog, Parsed, parse_manifest
from .layout import SNAPSHOT_NAME
from .manifest import MANIFEST_DIR, ManifestError
from .snapshot import encode


async def build_catalog(view: ObjectBackend, *, ttl_s: float | None, concurrency: int = 16) -> Catalog:
    """A catalog of every readable manifest under ``view`` (its own prefix only)."""
    names = [o.name for o in await view.list(MANIFEST_DIR) if o.name.endswith(".json")]
    sem = asyncio.Semaphore(concurrency)

    async def fetch(n: str) -> tuple[str, Parsed | None]:
        async with sem:
            raw = await view.get_bytes(n)
        try:
            return n, None if raw is None else parse_manifest(raw)
        except ManifestError:
            return n, None

    got = await asyncio.gather(*(fetch(n) for n in names))
    cat = Catalog(namespaced=True)
    cutoff = None if ttl_s is None else time.time() - ttl_s
    await asyncio.to_thread(cat.add_parsed, [g for g in got if g[1] is not None], cutoff=cutoff)
    return cat


async def write_namespace_snapshot(view: ObjectBackend, *, ttl_s: float | None) -> int:
    """Publish ``index/snapshot.idx`` for ``view``; returns the blocks it holds."""
    cat = await build_catalog(view, ttl_s=ttl_s)
    raw = await asyncio.to_thread(lambda: encode(cat.to_snapshot(cat.retained)))  # manifests' retain fields
    await view.put_object(SNAPSHOT_NAME, raw)
    return len(cat)
