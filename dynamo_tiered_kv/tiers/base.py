"""The tier interface: one small async ABC every storage backend implements.

Contract shared by all tiers:

* Values are whole encoded records (``codec``) addressed by 16-byte block keys. Tiers store
  bytes; they never interpret them. Verification happens where bytes are consumed.
* ``contains`` / ``size_of`` / ``keys`` answer from memory (an index), never from I/O, so the
  scheduler can call them on its hot path.
* Reads go into caller-owned memory (a staging slab slice); tiers never allocate the result.
  A missing key is ``None``, not an exception. Faults raise ``TierUnavailable``.
* ``write_many`` keeps the given order: blocks of one sequence land contiguously where the
  medium has an order (SSD segments), so a prefix restores with one read.
* Capacity is enforced: a write evicts by the tier's policy or raises ``TierFull``. Eviction
  honours the tier's retention table (``retention``): expired blocks first, unprotected ones
  (least recently used) next, protected ones last, lowest class first.
* Everything the store or the flusher uses of a tier is declared here, abstract or with a
  default; nobody probes a tier for optional members or sets attributes on it. The store
  configures a tier through methods (``configure_retention``, ``set_residency_hook``).
* A read made under ``read_budget`` (a restore that recomputing would beat after a while) ends
  by the budget's deadline where the tier can bound its I/O (the object tier): what cannot
  arrive in time is a miss.

Only coroutine methods may do I/O; they run blocking work in threads, never on the loop.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..blocks.keys import BlockKey
from ..policy.retention import RetentionClasses

if TYPE_CHECKING:
    from ..staging.device_slabs import DeviceSpan
    from .segments import SealedSegment
    from .ssd.gds import DeviceIO

log = logging.getLogger(__name__)

#: expired blocks taken off a retention table per delete batch of ``Tier.expire``
EXPIRE_STEP = 256


@dataclass(frozen=True, slots=True)
class ByteRange:
    """``length`` bytes starting at ``start`` inside one record."""

    start: int
    length: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 0:
            raise ValueError("ByteRange start and length must be non-negative")


@dataclass(frozen=True, slots=True)
class ReadRequest:
    key: BlockKey
    into: memoryview | DeviceSpan  # writable, at least the record (or range) length; device: SSD GPU-direct only
    byte_range: ByteRange | None = None


@dataclass(frozen=True)
class TierCapabilities:
    medium: str  # "host", "ssd", "object"
    durable: bool  # survives a process restart
    shared: bool  # other nodes can read what this node wrote
    byte_ranges: bool = True


@dataclass(frozen=True)
class TierUsage:
    capacity_bytes: int
    used_bytes: int
    num_blocks: int


@dataclass
class ReadBudget:
    """Until when the reads of one restore are worth waiting for (``time.monotonic()``): past it
    recomputing the blocks is cheaper. A tier that can bound its I/O reads within it: a read it
    expects to miss the deadline is a miss at once (``gave_up = "estimate"``, nothing sent), one
    still running at the deadline gives up (``gave_up = "budget"``). Set by the store before its
    reads; ``gave_up`` is written by the tier on the store's loop and read by the store once the
    read has completed."""

    deadline: float
    gave_up: str | None = None


_read_budget: ContextVar[ReadBudget | None] = ContextVar("dtkv_read_budget", default=None)


@contextlib.contextmanager
def read_budget(budget: ReadBudget | None) -> Iterator[None]:
    """Reads made inside (in tasks created inside, too) are bounded by ``budget`` (None: none)."""
    token = _read_budget.set(budget)
    try:
        yield
    finally:
        _read_budget.reset(token)


def current_read_budget() -> ReadBudget | None:
    """The ``read_budget`` the current read runs under, if any."""
    return _read_budget.get()


class ResidencyHook(Protocol):
    """What a tier tells the store of its own accord (``policy.residency.TierHook``): blocks it
    dropped (capacity eviction, expiry), and blocks that reached the shared tier (SSD segments
    marked flushed). Called on the thread that made the change, never under the tier's lock."""

    def evicted(self, keys: Sequence[BlockKey]) -> None: ...

    def flushed(self, keys: Sequence[BlockKey]) -> None: ...


@dataclass(frozen=True)
class TierExpiry:
    """One ``Tier.expire`` pass: blocks no longer served and their bytes."""

    blocks: int = 0
    bytes: int = 0


class RecordPin(Protocol):
    """Records ``Tier.pin_records`` returned in place; ``release`` once they are no longer read."""

    def release(self) -> None: ...


class Tier(abc.ABC):
    """One storage tier (module docstring). Subclasses implement the abstract methods; every other
    member has a default that describes a plain tier.

    Threads: index lookups (``contains`` ...) and the read-shape attributes may be read from any
    thread; coroutines run on the caller's loop; ``configure_retention`` and
    ``set_residency_hook`` are called by the store before the tier is used (the hook may be
    replaced later: hooks are immutable, a tier reads its hook once per report).
    """

    name: str = "tier"
    capabilities: TierCapabilities

    # --- how the store shapes reads of this tier (defaults: a plain tier) ------------------
    #: reads in flight across all loads at most (None: no gate)
    read_parallelism: int | None = None
    #: pieces one run is cut into at most when there is no gate
    max_concurrency: int = 1
    #: smallest piece a run is cut into (None: the store's default)
    read_piece_bytes: int | None = None
    #: piece size for frugal (paced) reads (None: ``read_piece_bytes``)
    frugal_piece_bytes: int | None = None
    #: chunk a load from this tier asks for (None: a staging slab)
    load_chunk_bytes: int | None = None
    #: whether ``read_slab_now`` reads on the caller's thread (False: it returns None)
    slab_reads_now: bool = False
    #: whether ``read_split_now`` reads records straight into the caller's buffers (False: it returns None)
    split_reads_now: bool = False
    #: whether loads into the caller's buffers read this tier with ``read_split`` on the store's
    #: loop (a tier whose reads are requests that can be cancelled: the object tier); False and
    #: no ``split_reads_now``: such loads leave this tier's records to staging
    split_reads: bool = False

    #: state the tier owns, set through ``configure_retention`` / ``set_residency_hook``
    _retention: RetentionClasses | None = None
    _residency_hook: ResidencyHook | None = None

    # --- in-memory index (no I/O) -------------------------------------------------------
    @abc.abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether the tier holds ``key``. Memory only; never blocks on I/O."""

    @abc.abstractmethod
    def size_of(self, key: BlockKey) -> int | None:
        """Stored length of ``key``'s record, or None if absent. Memory only."""

    @abc.abstractmethod
    def keys(self) -> Iterator[BlockKey]:
        """Snapshot iterator over stored keys. Memory only."""

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Capacity bound and current use."""

    def contains_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading keys present (memory only)."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    @property
    def index_ready(self) -> bool:
        """Whether lookups answer from a complete index (the object tier: after its first listing)."""
        return True

    @property
    def reads_in_place(self) -> bool:
        """Whether records may be verified where the tier keeps them (host memory): then
        ``pin_records`` is implemented."""
        return False

    @property
    def device_io(self) -> DeviceIO | None:
        """GPU-direct I/O for reads and writes of device spans; None: host staging only."""
        return None

    # --- reads: ``read_many`` is the primitive ----------------------------------------------
    @abc.abstractmethod
    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        """Copy each request's record (or byte range) into its ``into``; per request the bytes
        copied, None if absent (or unreadable: corrupt bytes are a miss, never served).

        Raises ValueError if a destination is too small or a range exceeds its record.
        """

    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        """``read_many`` of one request."""
        return (await self.read_many([ReadRequest(key, into, byte_range)]))[0]

    async def read_slab(self, keys: Sequence[BlockKey], dest: np.ndarray, record_bytes: int) -> list[int | None]:
        """Whole records ``keys[i]`` into ``dest[i * record_bytes:(i + 1) * record_bytes]`` (one host
        buffer of uint8). A record whose length is not ``record_bytes`` is a miss (None)."""
        if dest.nbytes < len(keys) * record_bytes:
            raise ValueError(f"destination holds {dest.nbytes} bytes, {len(keys)} records need "
                             f"{len(keys) * record_bytes}")
        flat = dest.reshape(-1).view(np.uint8)
        want = [i for i, k in enumerate(keys) if self.size_of(k) == record_bytes]
        got = await self.read_many([ReadRequest(keys[i], memoryview(flat[i * record_bytes:(i + 1) * record_bytes]))
                                    for i in want])
        out: list[int | None] = [None] * len(keys)
        for i, n in zip(want, got):
            out[i] = n if n == record_bytes else None
        return out

    def read_slab_now(self, keys: Sequence[BlockKey], dest: np.ndarray, record_bytes: int) -> list[int | None] | None:
        """``read_slab`` on the calling thread (blocking), where the tier has such a path
        (``slab_reads_now``); None: it has none, use ``read_slab``."""
        return None

    def read_split_now(self, keys: Sequence[BlockKey], parts: Sequence[Sequence[np.ndarray]],
                       record_bytes: int) -> list[int | None] | None:
        """Whole records ``keys[i]`` read on the calling thread (blocking), each record's bytes laid,
        in order, over the caller's buffers ``parts[i]`` (contiguous uint8 arrays whose sizes add
        up to ``record_bytes``: e.g. a scratch for the header, the caller's own destination of the
        payload, a scratch for the padding), with no staging copy in between. Per record
        ``record_bytes`` or None (absent, another length, or a failed read: its buffers then hold
        unspecified bytes). Nothing is verified here. None: the tier has no such path
        (``split_reads_now`` is False)."""
        return None

    async def read_split(self, keys: Sequence[BlockKey], parts: Sequence[Sequence[np.ndarray]],
                         record_bytes: int) -> list[int | None]:
        """``read_split_now``'s contract as a coroutine: whole records ``keys[i]`` laid, in order,
        over the caller's buffers ``parts[i]``; per record ``record_bytes`` or None. Nothing is
        verified. Cancelling it returns only once nothing writes into ``parts`` any more (as
        ``read_many``). The default reads every part as a byte range of its record in one
        ``read_many``, so a tier that merges adjacent ranges into one request (the object tier:
        one ranged GET per run of records in one object) reads a run of records with one request
        straight into the parts."""
        reqs: list[ReadRequest] = []
        owners: list[int] = []
        for i, (k, own) in enumerate(zip(keys, parts, strict=True)):
            if sum(p.nbytes for p in own) != record_bytes:
                raise ValueError(f"the parts of record {i} hold {sum(p.nbytes for p in own)} bytes, not {record_bytes}")
            if self.size_of(k) != record_bytes:
                continue
            at = 0
            for p in own:
                reqs.append(ReadRequest(k, memoryview(p.reshape(-1).view(np.uint8)), ByteRange(at, p.nbytes)))
                owners.append(i)
                at += p.nbytes
        got = await self.read_many(reqs) if reqs else []
        done = [0] * len(keys)
        for i, (r, n) in enumerate(zip(reqs, got)):
            if n == r.into.nbytes:
                done[owners[i]] += n
        return [record_bytes if d == record_bytes else None for d in done]

    def pin_records(self, keys: Sequence[BlockKey],
                    spill: Callable[[int], np.ndarray]) -> tuple[list[np.ndarray], RecordPin]:
        """Views of the records of the leading ``keys`` present (stopping at the first absent one),
        where the tier keeps them, valid until the returned pin is released; a record the tier
        cannot show in place is copied into ``spill(j)``. Only called when ``reads_in_place``."""
        raise NotImplementedError(f"{type(self).__name__} does not read in place (reads_in_place is False)")

    # --- writes and deletes -----------------------------------------------------------------
    @abc.abstractmethod
    async def write(self, key: BlockKey, data: memoryview) -> None:
        """Store ``data`` under ``key`` (replacing any previous value). May evict others."""

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview]]) -> None:
        """Batched ``write`` in order; backends override to append a run contiguously."""
        for key, data in items:
            await self.write(key, data)

    @abc.abstractmethod
    async def delete(self, key: BlockKey) -> bool:
        """Remove ``key``; return whether it was present."""

    async def delete_many(self, keys: Iterable[BlockKey]) -> int:
        """Batched ``delete``; return how many were present. Backends override to batch the I/O."""
        n = 0
        for key in keys:
            n += bool(await self.delete(key))
        return n

    # --- retention and residency: owned by the tier, configured by the store ------------------
    @property
    def retention(self) -> RetentionClasses:
        """The tier's retention table; its eviction honours it. Built with the default share
        bound until ``configure_retention`` replaces it."""
        if self._retention is None:
            self._retention = RetentionClasses(self.usage().capacity_bytes, clock=time.time, tier=self.name)
        return self._retention

    def configure_retention(self, *, max_share: float, clock: Callable[[], float]) -> RetentionClasses:
        """Build the tier's retention table (``max_share`` of its capacity may be protected, expiries
        measured on ``clock``; per tenant, ``max_share`` of ``tenant_limit``) and return it. Called by the
        store once, before the tier is used."""
        self._retention = RetentionClasses(self.usage().capacity_bytes, max_share=max_share, clock=clock,
                                           tier=self.name, tenant_limit=self.tenant_limit)
        return self._retention

    def tenant_limit(self, tenant: str) -> int:
        """The bytes ``tenant`` (a hex tenant id, as hint holders name it) may hold here: its quota on
        a tier with quotas (``policy.quotas``), the capacity otherwise."""
        return self.usage().capacity_bytes

    def tenant_usage(self) -> dict[bytes, tuple[int, int]] | None:
        """Bytes and blocks each tenant holds here (a copy); None: this tier does not account by
        tenant."""
        return None

    def erasures(self) -> dict[bytes, float]:
        """Tenants erased cluster-wide as this tier knows them (tenant -> unix time of the erase):
        the object tier reads the bucket's erasure markers; a tier with no shared view knows none."""
        return {}

    async def erase_tenant(self, tenant: bytes) -> int:
        """Drop every block of ``tenant`` this tier holds (an erasure); returns how many. This default
        reads each record's header (``blocks.codec.record_tenant``): tiers that index tenants
        override it."""
        from ..blocks.codec import record_tenant

        head = bytearray(128)
        doomed = []
        for key in list(self.keys()):
            n = await self.read_into(key, memoryview(head)[:120], ByteRange(0, 120))
            if n == 120 and record_tenant(head) == tenant:
                doomed.append(key)
        n = await self.delete_many(doomed)
        if self._retention is not None:
            self._retention.forget(doomed)
        self._report_evicted(doomed)
        return n

    def set_residency_hook(self, hook: ResidencyHook | None) -> None:
        """The listener told of blocks the tier drops on its own (capacity eviction, expiry)."""
        self._residency_hook = hook

    @property
    def residency_hook(self) -> ResidencyHook | None:
        """The hook ``set_residency_hook`` installed (None: nobody listens)."""
        return self._residency_hook

    def _report_evicted(self, keys: Sequence[BlockKey]) -> None:
        """Tell the residency hook (read once) that ``keys`` left the tier."""
        hook = self._residency_hook
        if keys and hook is not None:
            hook.evicted(keys)

    # --- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:  # noqa: B027 - optional hook
        """Recover state (index rebuild). Called once before use."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources. Idempotent."""

    async def seal(self) -> SealedSegment | None:
        """Make everything written durable and readable by the flusher (the SSD tier seals its
        open segment and returns it). Idempotent; the default has nothing to seal."""
        return None

    async def expire(self, now: float, max_bytes: int) -> TierExpiry:
        """One GC pass: retained blocks whose expiry is at or before ``now`` leave the tier, about
        ``max_bytes`` at most (whole delete batches). Protected and ordinary blocks stay. The
        dropped keys are told to the residency hook. A failed delete batch is logged and skipped."""
        cls = self.retention
        blocks = nbytes = 0
        while nbytes < max_bytes:
            batch = cls.expired(now, EXPIRE_STEP)
            if not batch:
                break
            sizes = {key: n for key, _ in batch if (n := self.size_of(key)) is not None}
            if not sizes:
                continue
            try:
                blocks += await self.delete_many(list(sizes))
            except Exception as e:
                log.warning("expiry delete from tier %s failed: %s", self.name, e)
                continue
            gone = [key for key in sizes if not self.contains(key)]
            nbytes += sum(sizes[key] for key in gone)
            self._report_evicted(gone)
        return TierExpiry(blocks, nbytes)

    async def __aenter__(self) -> Tier:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def check_range(record_len: int, into: memoryview, byte_range: ByteRange | None) -> tuple[int, int]:
    """Validate a read and return (offset, length) inside the record."""
    off, length = (0, record_len) if byte_range is None else (byte_range.start, byte_range.length)
    if off + length > record_len:
        raise ValueError(f"byte range [{off}, {off + length}) exceeds record of {record_len} bytes")
    if into.nbytes < length:
        raise ValueError(f"destination holds {into.nbytes} bytes, read needs {length}")
    return off, length
