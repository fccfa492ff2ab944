"""G2 host tier: an LRU cache of records in one preallocated, pre-faulted arena.

The arena is cut into fixed chunks once; a record takes ``ceil(len / chunk)`` chunks from a free
list, so writes never allocate and the byte capacity is exact. Eviction is least recently used
(a read or write makes a key most recent), within retention classes (``retention``): expired
blocks go first, then unprotected ones in LRU order, protected ones only when nothing else is
left (lowest priority first). A protected block skipped by eviction moves to the recent end, so
each is stepped over once, not on every write. Copies are numpy memcpys; the tier holds a lock only
around index updates, and copies are done under it too since they are short and memory-bound.

The arena is not pinned (``cudaHostRegister``) by default, CUDA or not: it is never a DMA source
or target. GPU layouts move records through the staging slabs, which are pinned; the arena is
only memcpy'd to and from them, and pinning a host tier's worth of memory would take it from the
OS for nothing and slow start-up by the registration of every page.

``pin_records`` lets the store verify and scatter records where they lie in the arena (no copy
into a staging slab): a pinned record's chunks are not reused until ``HostPin.release``, even if
the key is evicted, overwritten or deleted meanwhile (its bytes then briefly count as free).

Tenants (``policy/quotas.py``): every record's tenant (its header's tenant field) is counted in a
ledger (record bytes, ``tenant_usage``) and charged the arena bytes its record takes (whole chunks:
a 132 KiB record in 256 KiB chunks costs 256 KiB, so limits that add up to the capacity fit in the
arena); with quotas, a tenant at its limit evicts its own blocks (per-tenant LRU orders, the same
retention rules) and a full arena evicts tenants over their limit first, so one tenant's traffic
never evicts another's blocks held within its limit.

Threads: the store's loop writes, reads and deletes; loading threads pin and unpin; engine threads
ask ``contains``/``size_of``. The index, free list, pin counts and byte count are changed only under
``_lock``; ``contains`` and ``size_of`` are one dict lookup each without it (atomic under the GIL,
and the scheduler's hot path must not wait behind a copy). Eviction is reported after the lock is
released (``residency_hook``, ``on_evict``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..blocks.codec import record_tenant
from ..blocks.keys import BlockKey
from ..errors import TierFull
from ..policy.quotas import TenantLedger, TenantQuotas, holder_limit
from ..staging.slabs import Slab
from .base import ByteRange, ReadRequest, Tier, TierCapabilities, TierUsage, check_range

DEFAULT_CHUNK_BYTES = 256 * 1024


class HostTier(Tier):
    name = "host"
    capabilities = TierCapabilities(medium="host", durable=False, shared=False)
    #: a restore from host memory alone is verified and scattered in place in chunks of up to a
    #: staging slab: there is no read to overlap, and each chunk costs a hand-off to the store's
    #: loop and back (a 15 MiB restore in three chunks waited 2.4-4.6x its memcpy)
    load_chunk_bytes: int | None = 64 << 20

    def __init__(
        self,
        capacity_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pin: bool = False,
        on_evict: Callable[[BlockKey], None] | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        if capacity_bytes <= 0 or chunk_bytes <= 0:
            raise ValueError("capacity_bytes and chunk_bytes must be positive")
        n_chunks = max(1, capacity_bytes // chunk_bytes)
        self._chunk = chunk_bytes
        self._capacity = n_chunks * chunk_bytes
        self._arena = Slab(0, self._capacity, pin)
        self._chunks = self._arena.array.reshape(n_chunks, chunk_bytes)
        self._free: list[int] = list(range(n_chunks - 1, -1, -1))
        self._index: OrderedDict[BlockKey, tuple[int, list[int]]] = OrderedDict()  # key -> (len, chunks)
        self._used = 0
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self._pins: dict[int, int] = {}  # id(chunk list) -> pin count; a pinned list is alive, so ids are unique
        self._unfreed: dict[int, list[int]] = {}  # pinned chunk lists whose key was dropped
        self._tenant_of: dict[BlockKey, bytes] = {}
        self.ledger = TenantLedger()  # record bytes per tenant (``tenant_usage``)
        self._charged = TenantLedger()  # arena bytes per tenant (whole chunks): what quotas limit
        self._quotas = quotas if quotas is not None and quotas.enforced else None
        # per-tenant LRU orders, kept only when quotas are enforced (a read then moves a key in two)
        self._lru: dict[bytes, OrderedDict[BlockKey, None]] = {}

    # --- index --------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def size_of(self, key: BlockKey) -> int | None:
        e = self._index.get(key)
        return None if e is None else e[0]

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter(list(self._index))

    def usage(self) -> TierUsage:
        with self._lock:  # bytes and count from the same moment
            return TierUsage(self._capacity, self._used, len(self._index))

    def tenant_limit(self, tenant: str) -> int:
        return holder_limit(self._quotas, tenant, self._capacity)

    async def erase_tenant(self, tenant: bytes) -> int:
        with self._lock:
            doomed = [k for k, t in self._tenant_of.items() if t == tenant]
            for k in doomed:
                self._drop(k)
        if self._retention is not None:
            self._retention.forget(doomed)
        self._report_evicted(doomed)
        return len(doomed)

    def tenant_usage(self) -> dict[bytes, tuple[int, int]]:
        with self._lock:
            return self.ledger.snapshot()

    # --- I/O (memory copies; cheap enough to run inline on the loop) --------------------------
    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        return self.read_sync(key, into, byte_range)

    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        # through ``read_into``, so a subclass that changes single reads changes batches too
        return [await self.read_into(r.key, r.into, r.byte_range) for r in requests]  # type: ignore[arg-type]

    def read_sync(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        dst = np.frombuffer(into, dtype=np.uint8)
        with self._lock:
            e = self._index.get(key)
            if e is None:
                return None
            length, chunks = e
            off, n = check_range(length, into, byte_range)
            self._touch(key)
            c = self._chunk
            pos = 0
            while pos < n:
                ci, co = divmod(off + pos, c)
                take = min(c - co, n - pos)
                dst[pos : pos + take] = self._chunks[chunks[ci], co : co + take]
                pos += take
            return n

    @property
    def reads_in_place(self) -> bool:
        """Whether loads may use ``pin_records``: not when a subclass changed how reads behave."""
        return type(self).read_into is HostTier.read_into and type(self).read_many is HostTier.read_many

    def pin_records(self, keys: Sequence[BlockKey],
                    spill: Callable[[int], np.ndarray]) -> tuple[list[np.ndarray], HostPin]:
        """Views of the records of the leading ``keys`` present (stops at the first absent one).

        A record stored in adjacent chunks is returned in place and pinned; any other is copied into
        ``spill(j)`` (a writable buffer of at least its length). Call ``release`` on the pin once the
        views are no longer read.
        """
        views: list[np.ndarray] = []
        pinned: list[list[int]] = []
        c = self._chunk
        arena = self._arena.array
        with self._lock:
            for j, key in enumerate(keys):
                e = self._index.get(key)
                if e is None:
                    break
                length, chunks = e
                self._touch(key)
                c0 = chunks[0] if chunks else 0
                if len(chunks) == 1 or chunks == list(range(c0, c0 + len(chunks))):
                    views.append(arena[c0 * c:c0 * c + length])
                    self._pins[id(chunks)] = self._pins.get(id(chunks), 0) + 1
                    pinned.append(chunks)
                    continue
                dst = spill(j)
                if dst.nbytes < length:
                    break
                for i, ch in enumerate(chunks):
                    part = min(c, length - i * c)
                    dst[i * c:i * c + part] = self._chunks[ch, :part]
                views.append(dst[:length])
        return views, HostPin(self, pinned)

    def _unpin(self, pinned: list[list[int]]) -> None:
        with self._lock:
            for chunks in pinned:
                n = self._pins[id(chunks)] - 1
                if n:
                    self._pins[id(chunks)] = n
                    continue
                del self._pins[id(chunks)]
                dropped = self._unfreed.pop(id(chunks), None)
                if dropped is not None:
                    self._free.extend(dropped)

    async def write(self, key: BlockKey, data: memoryview) -> None:
        self.write_sync(key, data)

    def write_sync(self, key: BlockKey, data: memoryview) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        need = -(-src.nbytes // self._chunk) if src.nbytes else 0
        if need * self._chunk > self._capacity:
            raise TierFull(f"record of {src.nbytes} bytes exceeds host tier capacity {self._capacity}")
        evicted: list[BlockKey] = []
        try:
            with self._lock:
                self._store_locked(key, src, need, evicted)
        finally:
            if self._on_evict is not None:
                for k in evicted:
                    self._on_evict(k)
            self._report_evicted(evicted)

    def _store_locked(self, key: BlockKey, src: np.ndarray, need: int, evicted: list[BlockKey]) -> None:
        self._drop(key)
        tenant = record_tenant(src)
        quotas = self._quotas
        if quotas is not None:  # room within the tenant's own limit, from its own blocks
            cost = need * self._chunk  # what the record takes from the arena (whole chunks)
            if cost > quotas.limit(tenant):
                raise TierFull(f"host tier: a {src.nbytes}-byte record ({cost} in chunks) exceeds its tenant's quota")
            if self._charged.bytes_of(tenant) + cost > quotas.limit(tenant):
                self._drop_expired_locked(evicted, tenant)
            while self._charged.bytes_of(tenant) + cost > quotas.limit(tenant):
                self._evict_locked(self._victim_locked(tenant), evicted)
        if len(self._free) < need:
            self._drop_expired_locked(evicted)
        while len(self._free) < need:
            if not self._index:  # the rest is pinned by loads in progress
                raise TierFull(f"host tier: {src.nbytes} bytes do not fit beside pinned records")
            over = self._charged.over(quotas) if quotas is not None else []
            self._evict_locked(self._victim_locked(over[0] if over else None), evicted)
        chunks = [self._free.pop() for _ in range(need)]
        c = self._chunk
        for i, ch in enumerate(chunks):
            part = src[i * c : (i + 1) * c]
            self._chunks[ch, : part.nbytes] = part
        self._index[key] = (src.nbytes, chunks)
        self._used += src.nbytes
        self._tenant_of[key] = tenant
        self.ledger.add(tenant, src.nbytes)
        self._charged.add(tenant, need * self._chunk)
        if quotas is not None:
            self._lru.setdefault(tenant, OrderedDict())[key] = None

    def _drop_expired_locked(self, evicted: list[BlockKey], tenant: bytes | None = None) -> None:
        """Expired blocks (of ``tenant``, or of anyone) go before any other."""
        if self._retention is None:
            return
        for old, _ in self._retention.expired():
            if (tenant is None or self._tenant_of.get(old) == tenant) and self._drop(old):
                evicted.append(old)

    def _evict_locked(self, key: BlockKey, evicted: list[BlockKey]) -> None:
        self._drop(key)
        evicted.append(key)
        if self._retention is not None:
            self._retention.forget([key])

    def _touch(self, key: BlockKey) -> None:
        self._index.move_to_end(key)
        if self._quotas is not None:
            self._lru[self._tenant_of[key]].move_to_end(key)

    def _victim_locked(self, tenant: bytes | None = None) -> BlockKey:
        """The least recently used unprotected key (of ``tenant``, or of anyone); if every such
        key is protected, the lowest class."""
        order = self._index if tenant is None else self._lru[tenant]
        cls = self._retention
        if cls is None or not len(cls):
            return next(iter(order))
        now = cls.clock()
        skipped: list[BlockKey] = []
        victim: BlockKey | None = None
        for k in order:
            if not cls.protected(k, now):
                victim = k
                break
            skipped.append(k)
        if victim is None:  # only protected blocks (the share bound keeps this rare): lowest yields
            return min(order, key=lambda k: cls.rank(k, now))
        for k in skipped:
            self._touch(k)
        return victim

    def _drop(self, key: BlockKey) -> bool:
        e = self._index.pop(key, None)
        if e is None:
            return False
        tenant = self._tenant_of.pop(key)
        self.ledger.remove(tenant, e[0])
        self._charged.remove(tenant, len(e[1]) * self._chunk)
        if self._quotas is not None:
            order = self._lru[tenant]
            del order[key]
            if not order:
                del self._lru[tenant]
        if id(e[1]) in self._pins:
            self._unfreed[id(e[1])] = e[1]  # a load reads it in place: free its chunks on unpin
        else:
            self._free.extend(e[1])
        self._used -= e[0]
        return True

    async def delete(self, key: BlockKey) -> bool:
        with self._lock:
            return self._drop(key)

    async def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._tenant_of.clear()
            self._lru.clear()
            self.ledger.clear()
            self._charged.clear()
            self._used = 0


class HostPin:
    """Records ``HostTier.pin_records`` returned in place; ``release`` once (idempotent)."""

    __slots__ = ("_pinned", "_tier")

    def __init__(self, tier: HostTier, pinned: list[list[int]]) -> None:
        self._tier: HostTier | None = tier
        self._pinned = pinned

    def release(self) -> None:
        tier, self._tier = self._tier, None
        if tier is not None and self._pinned:
            tier._unpin(self._pinned)
