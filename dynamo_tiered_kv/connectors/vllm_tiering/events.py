"""Residency of our store's tiers as vLLM 0.33 ``OffloadingEvent``s (``take_events``).

vLLM 0.33's offloading events know two media (``Medium.CPU``, ``Medium.STORAGE``) and two
localities (``LOCAL``, ``REMOTE``); its scheduler publishes them as ``BlockStored``/``BlockRemoved``
with ``medium="STORAGE"`` and the locality, which Dynamo 1.7's router credits to its Disk tier
for LOCAL events. So the SSD tier is ``STORAGE`` + ``LOCAL``; the shared object tier is
``STORAGE`` + ``REMOTE`` (every worker can restore from it, none holds it locally). A host tier,
when configured, is ``CPU`` + ``LOCAL``. Each of our tiers is its own ``ownership``
(``<tier_type>/ssd`` ...), so vLLM's event tracker keeps one residency per tier and removing a
block from the SSD never withdraws its object-tier announcement.

The store reports residency by our block key (``residency``); events need vLLM's offload key, so
the keys this tier stored or looked up are remembered in a bounded LRU. A key not remembered
(found on disk at start, written by another node, aged out) produces no event.

Tenants: these events cannot name one. vLLM's scheduler builds the ``BlockStored``/``BlockRemoved``
it publishes from an ``OffloadingEvent`` (keys, medium, locality, ownership, and two flags) and the
block metadata it recorded itself; nothing else a tier returns reaches the event. ``ownership`` is
the tier's identity in vLLM's residency tracking and stays that. Every block of this tier belongs
to the deployment's tenant anyway (the tier learns no request's ``cache_salt``; docs/TENANTS.md),
so a router attributes this worker's events to that tenant by deployment. That tenant's id (a
digest of the deployment's ``tenant_salt``, ``DynamoTieredKVTier.tenant``) is the one the tier's
records, ``dtkv tenants`` listings and ``dtkv_tenant_*`` metrics show.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from ...blocks.keys import BlockKey
from ...policy.residency import DISK, EXTERNAL, HOST

#: our residency medium -> (vLLM medium, locality, ownership suffix)
VLLM_MEDIUM: dict[str, tuple[Medium, Locality, str]] = {
    HOST: (Medium.CPU, Locality.LOCAL, "host"),
    DISK: (Medium.STORAGE, Locality.LOCAL, "ssd"),
    EXTERNAL: (Medium.STORAGE, Locality.REMOTE, "object"),
}


class TierEvents:
    """The store's ``ResidencyListener`` for this tier (thread-safe: the store's loop calls it)."""

    def __init__(self, tier_type: str, max_keys: int, ssd_locality: Locality = Locality.LOCAL) -> None:
        self.tier_type = tier_type
        self.max_keys = max_keys
        #: per medium; ``ssd_locality``: REMOTE for an ssd_dir on shared storage (the ``locality`` option)
        self.where = {**VLLM_MEDIUM, DISK: (Medium.STORAGE, ssd_locality, "ssd")}
        self._lock = threading.Lock()
        self._known: OrderedDict[BlockKey, OffloadKey] = OrderedDict()
        self._events: list[OffloadingEvent] = []

    def remember(self, keys: Sequence[BlockKey], offload_keys: Sequence[OffloadKey]) -> None:
        with self._lock:
            for k, ok in zip(keys, offload_keys, strict=True):
                self._known[k] = ok
                self._known.move_to_end(k)
            while len(self._known) > self.max_keys:
                self._known.popitem(last=False)

    def stored(self, medium: str, keys: Sequence[BlockKey]) -> None:
        self._add(medium, keys, removed=False)

    def removed(self, medium: str, keys: Sequence[BlockKey]) -> None:
        self._add(medium, keys, removed=True)

    def _add(self, medium: str, keys: Sequence[BlockKey], *, removed: bool) -> None:
        where = self.where.get(medium)
        if where is None:
            return
        with self._lock:
            offload_keys = [ok for ok in (self._known.get(bytes(k)) for k in keys) if ok is not None]
            if offload_keys:
                vllm_medium, locality, owner = where
                # removal_expected: every residency we announce is withdrawn by a removal event
                self._events.append(OffloadingEvent(keys=offload_keys, medium=vllm_medium, removed=removed,
                                                    locality=locality, ownership=f"{self.tier_type}/{owner}",
                                                    removal_expected=not removed))

    def take(self) -> list[OffloadingEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out
