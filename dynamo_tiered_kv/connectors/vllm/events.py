"""KV cache events: tell vLLM's event publisher (and Dynamo's KV router) which tier of this worker
holds which prefix blocks.

One ``BlockStored`` per run of blocks a tier now holds and one ``BlockRemoved`` per batch a tier
dropped, in vLLM's own event vocabulary where the installed vLLM has it (``MEDIUM_STORAGE`` and
the ``locality``/``ownership`` fields: vLLM >= 0.32), the one vLLM's tiered offloading uses and
Dynamo 1.7's router credits: host tier ``CPU`` + ``LOCAL`` (HostPinned), SSD tier ``STORAGE`` +
``LOCAL`` (Disk), shared object tier ``STORAGE`` + ``REMOTE`` (a shared pool: the router does not
credit it to this worker). Each tier is its own ``ownership`` (``dtkv/ssd`` ...). An older vLLM
gets the router's legacy names (``CPU_PINNED``, ``DISK``, ``EXTERNAL`` + ``REMOTE``). A block in
two tiers is announced once per tier; every tier's removal is its own event. Internally
(``residency``, this module's arguments) tiers keep the legacy names; ``residency_of`` maps an
event back.

Worker side (``BlockResidency``): the store reports residency changes by key; the worker maps a
key back to what an event needs (token hash, parent, tokens, LoRA) for the blocks it offloaded
itself, kept in a bounded LRU. A key that is not there (blocks found at start, blocks another
node wrote, entries aged out) produces no event; an entry that ages out first has its tiers
announced removed, so the router never keeps a block this worker can no longer account for.

Scheduler side (``ResidencyLedger``): a block is restorable from a tier only if every worker of
the engine (TP x PP ranks) holds its shard there. Stored is announced once the last worker
reported it, removed as soon as the first one dropped it, whatever step each rank reported in.
Block hashes are the connector's token hashes (first 8 bytes as an int), chained through
``parent_block_hash``. Emitted only with ``--kv-events-config '{"enable_kv_cache_events": true}'``.

Tenants: every stored and removed event names its blocks' tenant in one more field,
``dtkv_tenant``: the tenant id as 16 hex digits (``blocks.tenant``: a keyed digest of the request's
``cache_salt``, never the salt; ``0000000000000000`` for requests without one). vLLM's event
classes have no such field, so the events are ``TenantBlockStored``/``TenantBlockRemoved``:
subclasses that keep vLLM's tag, so on the wire they are vLLM's tagged maps with one more key.
Decoders that do not know it skip it (msgspec with vLLM's classes, Dynamo's router, which reads
known keys and ignores the rest); a router or indexer that accounts by tenant reads it. The
events of one run or removal batch share one tenant (a run breaks where the tenant changes).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec
from vllm.distributed import kv_events as _kv_events
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from ...blocks.tenant import DEFAULT_TENANT, tenant_hex
from ...policy.residency import DISK, EXTERNAL, HOST


@dataclass(frozen=True)
class EventMedium:
    """How one tier is named in events: ``medium``, ``locality`` and ``ownership`` fields."""

    medium: str
    locality: str | None
    ownership: str | None


def _fields(cls: type) -> frozenset[str]:
    return frozenset(getattr(cls, "__struct_fields__", ()))


#: vLLM's own vocabulary (kv_events.MEDIUM_STORAGE, locality and ownership fields) is installed
STORAGE_VOCABULARY = hasattr(_kv_events, "MEDIUM_STORAGE") and {"locality", "ownership"} <= _fields(BlockStored)
#: our residency medium -> its name in events
EVENT_MEDIUM: dict[str, EventMedium] = {
    HOST: EventMedium("CPU", "LOCAL", "dtkv/host"),
    DISK: EventMedium("STORAGE", "LOCAL", "dtkv/ssd"),
    EXTERNAL: EventMedium("STORAGE", "REMOTE", "dtkv/object"),
} if STORAGE_VOCABULARY else {
    HOST: EventMedium(HOST, None, None), DISK: EventMedium(DISK, None, None),
    EXTERNAL: EventMedium(EXTERNAL, "REMOTE", None),
}
_RESIDENCY_OF = {(e.medium, e.locality): m for m, e in EVENT_MEDIUM.items()}
#: the router tier each medium's events land in (ai-dynamo StorageTier::from_kv_medium)
ROUTER_TIER = {HOST: "HostPinned", DISK: "Disk", EXTERNAL: "Disk" if STORAGE_VOCABULARY else "External"}
DEFAULT_TRACKED_BLOCKS = 1 << 18


def residency_of(event: BlockStored | BlockRemoved) -> str | None:
    """Our residency medium (``residency.HOST``...) an event of ours names, or None."""
    return _RESIDENCY_OF.get((event.medium, getattr(event, "locality", None)))


def _where(medium: str) -> dict[str, str | None]:
    e = EVENT_MEDIUM[medium]
    out: dict[str, str | None] = {"medium": e.medium, "locality": e.locality}
    if STORAGE_VOCABULARY:
        out["ownership"] = e.ownership
    return out


def external_hash(token_hash: bytes) -> int:
    return int.from_bytes(token_hash[:8], "little")


class TieredKVEvents(KVConnectorKVEvents):
    """One step's events of one worker; vLLM merges the workers' into the first one's object.

    ``world`` is the number of workers (TP x PP ranks) that must all hold a block's shards.
    """

    def __init__(self, num_workers: int = 1, world: int = 1) -> None:
        self._events: list[KVCacheEvent] = []
        self._workers = num_workers
        self.world = world

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TieredKVEvents:
        return self  # the scheduler's ResidencyLedger aggregates across steps

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 0


class TenantBlockStored(BlockStored, tag="BlockStored"):  # type: ignore[call-arg]
    """vLLM's ``BlockStored`` and the blocks' tenant (module docstring): same tag, one more field."""

    #: the blocks' tenant id, 16 hex digits (``blocks.tenant.tenant_hex``); None: not known
    dtkv_tenant: str | None = None

    def __hash__(self) -> int:  # vLLM's hash leaves out fields it does not know
        return hash((super().__hash__(), self.dtkv_tenant))


class TenantBlockRemoved(BlockRemoved, tag="BlockRemoved"):  # type: ignore[call-arg]
    """vLLM's ``BlockRemoved`` and the blocks' tenant (module docstring): same tag, one more field."""

    #: the blocks' tenant id, 16 hex digits (``blocks.tenant.tenant_hex``); None: not known
    dtkv_tenant: str | None = None

    def __hash__(self) -> int:
        return hash((super().__hash__(), self.dtkv_tenant))


def event_tenant(event: KVCacheEvent) -> bytes | None:
    """The tenant id an event of ours names (``dtkv_tenant``), or None for any other event."""
    text = getattr(event, "dtkv_tenant", None)
    return bytes.fromhex(text) if text else None


def block_stored(token_hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
                 block_size: int, *, medium: str, lora_id: int | None = None,
                 lora_name: str | None = None, tenant: bytes = DEFAULT_TENANT) -> TenantBlockStored:
    """One event for a run of consecutive blocks of one tier (of one LoRA adapter, or the base
    model, and one tenant)."""
    return TenantBlockStored(block_hashes=[external_hash(h) for h in token_hashes],
                             parent_block_hash=external_hash(parent) if parent else None,
                             token_ids=list(token_ids), block_size=block_size, lora_id=lora_id,
                             lora_name=lora_name, dtkv_tenant=tenant_hex(tenant), **_where(medium))


def block_removed(hashes: Sequence[int], medium: str, tenant: bytes = DEFAULT_TENANT) -> TenantBlockRemoved:
    """One event for blocks of one tenant that one tier dropped."""
    return TenantBlockRemoved(block_hashes=list(hashes), dtkv_tenant=tenant_hex(tenant), **_where(medium))


# --- worker side -------------------------------------------------------------------------------
@dataclass(slots=True)
class _Block:
    token_hash: bytes
    parent: bytes | None
    tokens: array
    lora_id: int | None
    lora_name: str | None
    tenant: bytes
    mediums: set[str]


class BlockResidency:
    """The worker's ``ResidencyListener``: store keys -> vLLM events (thread-safe).

    ``track`` registers blocks before they are offloaded; ``stored``/``removed`` (called by the
    store, any thread) queue events for tracked keys only, each medium at most once per residency;
    ``take`` hands the queued events over. At most ``max_blocks`` keys are tracked (LRU).
    """

    def __init__(self, block_size: int, max_blocks: int = DEFAULT_TRACKED_BLOCKS) -> None:
        self.block_size = block_size
        self.max_blocks = max(1, max_blocks)
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._events: list[KVCacheEvent] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def track(self, keys: Sequence[bytes], token_hashes: Sequence[bytes], parent: bytes | None,
              token_ids: Sequence[int], *, lora_id: int | None = None, lora_name: str | None = None,
              tenant: bytes = DEFAULT_TENANT, holders: Callable[[bytes], Iterable[str]] | None = None) -> None:
        """Remember blocks about to be offloaded (``token_hashes[i]`` is ``keys[i]``'s, chained from
        ``parent``), of the request's ``tenant`` (``blocks.tenant``). ``holders(key)``: mediums
        already holding a newly tracked key (announced now)."""
        bs = self.block_size
        fresh: list[bytes] = []
        with self._lock:
            prev = parent
            for i, (k, h) in enumerate(zip(keys, token_hashes, strict=True)):
                b = self._blocks.get(k)
                if b is None:
                    self._blocks[k] = _Block(h, prev, array("I", token_ids[i * bs:(i + 1) * bs]), lora_id,
                                             lora_name, tenant, set())
                    fresh.append(k)
                else:
                    self._blocks.move_to_end(k)
                prev = h
            self._trim_locked()
            if holders is not None and fresh:
                by_medium: dict[str, list[bytes]] = {}
                for k in fresh:
                    for m in holders(k):
                        by_medium.setdefault(m, []).append(k)
                for m, ks in by_medium.items():
                    self._stored_locked(m, ks)

    def _trim_locked(self) -> None:
        gone: dict[tuple[str, bytes], list[int]] = {}
        while len(self._blocks) > self.max_blocks:
            _, b = self._blocks.popitem(last=False)
            for m in b.mediums:  # no longer accounted for: the router must not keep it
                gone.setdefault((m, b.tenant), []).append(external_hash(b.token_hash))
        self._removed_locked(gone)

    def _removed_locked(self, gone: dict[tuple[str, bytes], list[int]]) -> None:
        """One removal event per (medium, tenant) of ``gone``."""
        for (m, tenant), hashes in gone.items():
            self._events.append(block_removed(hashes, m, tenant))

    def stored(self, medium: str, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._stored_locked(medium, keys)

    def _stored_locked(self, medium: str, keys: Sequence[bytes]) -> None:
        run: list[_Block] = []
        for k in keys:
            b = self._blocks.get(bytes(k))
            if b is None or medium in b.mediums:
                self._flush_run(medium, run)
                continue
            b.mediums.add(medium)
            self._blocks.move_to_end(bytes(k))
            if run and (b.parent != run[-1].token_hash
                        or (b.lora_id, b.lora_name, b.tenant) != (run[0].lora_id, run[0].lora_name, run[0].tenant)):
                self._flush_run(medium, run)
            run.append(b)
        self._flush_run(medium, run)

    def _flush_run(self, medium: str, run: list[_Block]) -> None:
        if not run:
            return
        tokens: list[int] = []
        for b in run:
            tokens.extend(b.tokens)
        self._events.append(block_stored([b.token_hash for b in run], run[0].parent, tokens, self.block_size,
                                         medium=medium, lora_id=run[0].lora_id, lora_name=run[0].lora_name,
                                         tenant=run[0].tenant))
        run.clear()

    def removed(self, medium: str, keys: Sequence[bytes]) -> None:
        with self._lock:
            gone: dict[tuple[str, bytes], list[int]] = {}
            for k in keys:
                b = self._blocks.get(bytes(k))
                if b is not None and medium in b.mediums:  # unknown or never announced: nothing to say
                    b.mediums.discard(medium)
                    gone.setdefault((medium, b.tenant), []).append(external_hash(b.token_hash))
            self._removed_locked(gone)

    def reset(self) -> None:
        """Cache reset (new weights): every announced block is unusable; say so and forget them all."""
        with self._lock:
            gone: dict[tuple[str, bytes], list[int]] = {}
            for b in self._blocks.values():
                for m in b.mediums:
                    gone.setdefault((m, b.tenant), []).append(external_hash(b.token_hash))
            self._blocks.clear()
            self._removed_locked(gone)

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out


# --- scheduler side ----------------------------------------------------------------------------
class ResidencyLedger:
    """Turns the workers' per-rank events into the engine's: a (medium, block) is announced stored
    when all ``world`` workers hold it and removed when the first one drops it.

    Only blocks some but not all workers hold are kept (each worker reports a medium's stored and
    removed alternately, so an absent entry means none or all, and the event kind says which), at
    most ``max_partial`` of them; past that the oldest is forgotten, and a later report of it may
    go unannounced (stored) or be announced twice (removed).
    """

    def __init__(self, max_partial: int = 1 << 16) -> None:
        self.max_partial = max_partial
        self._partial: OrderedDict[tuple[str | None, str | None, int], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._partial)

    def apply(self, events: Iterable[KVCacheEvent], world: int) -> list[KVCacheEvent]:
        if world <= 1:
            return list(events)
        out: list[KVCacheEvent] = []
        for e in events:
            if isinstance(e, BlockStored):
                done = [i for i, h in enumerate(e.block_hashes) if self._count((e.medium, e.locality, h), +1, world)]
                out.extend(_sub_runs(e, done))
            elif isinstance(e, BlockRemoved):  # (medium, locality): the SSD and the object tier are both STORAGE
                gone = [h for h in e.block_hashes if self._count((e.medium, e.locality, h), -1, world)]
                if gone:
                    out.append(msgspec.structs.replace(e, block_hashes=gone))
            else:
                out.append(e)
        while len(self._partial) > self.max_partial:
            self._partial.popitem(last=False)
        return out

    def _count(self, key: tuple[str | None, str | None, int], delta: int, world: int) -> bool:
        """Apply one worker's report; True when the engine-wide state flips (announce it)."""
        held = self._partial.pop(key, None)
        if held is None:  # nobody (a store comes first) or everybody (a removal comes first)
            held, flips = (0 if delta > 0 else world), True
        else:
            flips = False
        held += delta
        if 0 < held < world:
            self._partial[key] = held
            return flips and delta < 0
        return held >= world and delta > 0


def _sub_runs(e: BlockStored, idx: list[int]) -> list[BlockStored]:
    """The blocks ``idx`` of ``e`` as events of consecutive blocks (``e`` itself when all)."""
    if len(idx) == len(e.block_hashes):
        return [e]
    out: list[BlockStored] = []
    bs = e.block_size
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        a, b = idx[i], idx[j] + 1
        parent = e.parent_block_hash if a == 0 else e.block_hashes[a - 1]
        out.append(msgspec.structs.replace(  # every other field (medium, locality, ownership...) as in e
            e, block_hashes=e.block_hashes[a:b], parent_block_hash=parent, token_ids=e.token_ids[a * bs:b * bs],
            extra_keys=e.extra_keys[a:b] if e.extra_keys else None))
        i = j + 1
    return out
