"""Tenant erasure on this node: when any tier learns that a tenant was erased cluster-wide (the
object tier reads the erasure markers ``dtkv tenants erase`` leaves in the bucket, on each index
refresh), every tier of this store drops that tenant's blocks (``Tier.erase_tenant``).

Bound: a node applies an erasure within ``interval_s`` of its object tier seeing the marker, so
within ``object_refresh_s + interval_s`` of the command (docs/TENANTS.md). A node that starts
later applies every marker still in the bucket within ``interval_s`` of its object index being
built (the markers are read as part of the build); until then, for those seconds, its own SSD may
still serve the tenant's blocks (with encryption, not once the tenant's key is gone).

Threads: the pass runs on the store's loop (``background``); tiers do their deletes there too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from ..blocks.tenant import tenant_hex
from .state import StoreState

log = logging.getLogger(__name__)


class ErasureService:
    """Applies cluster-wide tenant erasures to every tier of one store (module docstring)."""

    def __init__(self, state: StoreState, *, interval_s: float = 5.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._state = state
        self.tiers = state.tiers
        self.interval_s = interval_s
        self.applied: dict[bytes, float] = {}  # tenant -> the erase time applied (loop only)
        self.erased_blocks = 0

    def background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [("dtkv-erasure", self._apply_forever())]

    async def _apply_forever(self) -> None:
        while True:
            try:
                await self.apply()
            except Exception as e:  # a failing tier must not end erasure for good
                log.warning("applying tenant erasures failed (retried in %.0fs): %s", self.interval_s, e)
            await asyncio.sleep(self.interval_s)

    async def apply(self) -> int:
        """One pass: erase, on every tier, each tenant erased since the last pass. Returns blocks dropped."""
        wanted: dict[bytes, float] = {}
        for t in self.tiers:
            for tenant, at in t.erasures().items():
                wanted[tenant] = max(at, wanted.get(tenant, at))
        dropped = 0
        for tenant, at in wanted.items():
            if self.applied.get(tenant, -1.0) >= at:
                continue
            n = 0
            for t in self.tiers:
                n += await t.erase_tenant(tenant)
            self.applied[tenant] = at
            dropped += n
            log.info("tenant %s erased cluster-wide: dropped %d of its blocks here", tenant_hex(tenant), n)
        self.erased_blocks += dropped
        return dropped
