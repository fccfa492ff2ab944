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
* Capacity is enforced: a write evicts by the tier's policy or raises ``TierFull``.

Only coroutine methods may do I/O; they run blocking work in threads, never on the loop.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..blocks.keys import BlockKey

if TYPE_CHECKING:
    from ..staging.device_slabs import DeviceSpan


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


class Tier(abc.ABC):
    """One storage tier. Subclasses implement the abstract methods; batched calls have defaults."""

    name: str = "tier"
    capabilities: TierCapabilities

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

    # --- I/O ------------------------------------------------------------------------------
    @abc.abstractmethod
    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        """Copy the record (or ``byte_range`` of it) into ``into``; return bytes copied, None if absent.

        Raises ValueError if ``into`` is too small or the range exceeds the record.
        """

    @abc.abstractmethod
    async def write(self, key: BlockKey, data: memoryview) -> None:
        """Store ``data`` under ``key`` (replacing any previous value). May evict others."""

    @abc.abstractmethod
    async def delete(self, key: BlockKey) -> bool:
        """Remove ``key``; return whether it was present."""

    async def delete_many(self, keys: Iterable[BlockKey]) -> int:
        """Batched ``delete``; return how many were present. Backends override to batch the I/O."""
        n = 0
        for key in keys:
            n += bool(await self.delete(key))
        return n

    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        """Batched ``read_into``; backends override to coalesce contiguous runs into one I/O."""
        return [await self.read_into(r.key, r.into, r.byte_range) for r in requests]

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview]]) -> None:
        """Batched ``write`` in order; backends override to append a run contiguously."""
        for key, data in items:
            await self.write(key, data)

    def contains_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading keys present (memory only)."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Recover state (index rebuild). Called once before use."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources. Idempotent."""

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
