"""A tier whose records are sealed (encrypted for their tenant) at rest: wraps the SSD and object tiers.

``SealedTier(inner, cipher)`` is the tier the store sees. Every record it writes is sealed from
the caller's buffer into a buffer of its own (``blocks.sealed``: the payload encrypted with a data
key of the record's tenant in one pass, the header flagged and carrying the seal), so the staging
slab, which other tiers may still read, is never changed; every record it reads is opened in the
caller's buffer (decrypted in place: no copy) before the store verifies it. A record that does not
open (its tenant's key erased, unreachable or wrong, or any byte changed) is a miss: the caller
recomputes, nothing is deleted (a key store outage must not destroy data), and the count is in
``open_failures``.

Sealed bytes move between tiers untouched: the flusher uploads SSD segments as they are, so the
object tier holds the same sealed records; a promotion from objects to the SSD opens (read) and
seals again (write) under this process's data key.

A byte range of a sealed record cannot be checked on its own (one GCM tag covers the payload), so a
range read reads the whole record, opens it and copies the range. GPU-direct transfers are off
(``device_io`` is None): sealing runs on the host.

Cost: ``cryptography`` holds the GIL while it encrypts, so a second thread sealing adds little;
what helps is less work per record and cipher work that overlaps I/O. A batch is sealed, or
opened, on one thread hop with one key lookup per tenant (``RecordCipher.batch``); each record
gets 16 bytes of room after it for its tag (sealing: the next record's slot, written after it;
opening a slab: the next slot's first bytes, lent and put back), so its seal or open is one AEAD
call. At most ``SEAL_AHEAD`` write batches hold sealed copies at once (the inner tier
writes them one after another anyway), so their page-aligned buffers are reused, never faulted in
afresh.

Threads: ``write_many``/``read_many``/``read_slab`` run on the store's loop and do the cipher work
in the default executor (a first use of a tenant may wait on the key store, which runs on this
loop; ``TenantKeyStore.lookup`` never waits on its own loop's thread). ``read_slab_now`` opens on
the calling (restore) thread.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..blocks.keys import BlockKey
from ..blocks.sealed import open_record, seal_record
from ..errors import TierUnavailable
from ..tiers.base import ByteRange, ReadRequest, RecordPin, ResidencyHook, Tier, TierExpiry, TierUsage
from .cipher import SEAL_BYTES, TAG_BYTES, CipherBatch, RecordCipher, TenantKeyUnavailable

if TYPE_CHECKING:
    from ..policy.retention import RetentionClasses
    from ..tiers.segments import SealedSegment
    from ..tiers.ssd.gds import DeviceIO

log = logging.getLogger(__name__)

#: write batches that may hold sealed copies at once (one written, the next sealed meanwhile, ...)
SEAL_AHEAD = 4


def _aligned(nbytes: int) -> np.ndarray:
    """Page-aligned memory (anonymous mmap): O_DIRECT writes take it as it is."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE)), np.uint8)[:nbytes]


class _Buffers:
    """Reused page-aligned buffers for sealed copies: a write batch takes one, gives it back once
    the inner tier wrote it. The ``keep`` largest are kept, and a batch takes the smallest that
    fits, so a small batch never holds the buffer a large one needs (which would then fault fresh
    memory in). Every buffer has ``TAG_BYTES`` past the size asked for (the last record's tag
    scratch)."""

    def __init__(self, keep: int = SEAL_AHEAD) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        nbytes += TAG_BYTES
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return _aligned(max(nbytes, 1 << 20))

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:  # drop the smallest (by index: arrays do not compare as values)
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))


class SealedTier(Tier):
    """``inner`` with every record sealed at rest (module docstring)."""

    def __init__(self, inner: Tier, cipher: RecordCipher | Callable[[], RecordCipher]) -> None:
        self.inner = inner
        self._cipher_or_factory = cipher
        self._cipher: RecordCipher | None = cipher if isinstance(cipher, RecordCipher) else None
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.read_parallelism = inner.read_parallelism
        self.max_concurrency = inner.max_concurrency
        self.frugal_piece_bytes = inner.frugal_piece_bytes
        self.load_chunk_bytes = inner.load_chunk_bytes
        self.slab_reads_now = inner.slab_reads_now
        self._buffers = _Buffers()
        self._seal_slots: asyncio.Semaphore | None = None  # SEAL_AHEAD; made on the loop, at first use
        self.open_failures = 0  # records that did not open (a miss each)
        self.seal_failures = 0  # records not written because their tenant had no key

    @property
    def read_piece_bytes(self) -> int | None:  # type: ignore[override]
        """The inner tier's, as it is now (the object tier's follows its bucket)."""
        return self.inner.read_piece_bytes

    @property
    def cipher(self) -> RecordCipher:
        if self._cipher is None:
            raise TierUnavailable("sealed tier used before open()")
        return self._cipher

    # --- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        await self.inner.open()
        if self._cipher is None:
            factory = self._cipher_or_factory
            assert callable(factory)
            self._cipher = factory()  # type: ignore[assignment]

    async def close(self) -> None:
        await self.inner.close()

    # --- index (the inner tier's) -------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.inner.contains(key)

    def size_of(self, key: BlockKey) -> int | None:
        return self.inner.size_of(key)

    def keys(self) -> Iterator[BlockKey]:
        return self.inner.keys()

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def contains_prefix(self, keys: Sequence[BlockKey]) -> int:
        return self.inner.contains_prefix(keys)

    @property
    def index_ready(self) -> bool:
        return self.inner.index_ready

    @property
    def reads_in_place(self) -> bool:
        return False

    @property
    def device_io(self) -> DeviceIO | None:
        return None

    # --- reads: open in the caller's buffer ---------------------------------------------------
    def _open(self, buf: memoryview | np.ndarray, batch: CipherBatch | None = None, lent: int = 0) -> bool:
        rec = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
        if open_record(rec.reshape(-1).view(np.uint8), batch or self.cipher, SEAL_BYTES, lent=lent):
            return True
        self.open_failures += 1
        return False

    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        whole = [r for r in requests if r.byte_range is None]
        got = dict(zip(map(id, whole), await self.inner.read_many(whole), strict=True)) if whole else {}
        def open_all() -> dict[int, bool]:  # one hop to a thread for the whole batch
            batch = self.cipher.batch()
            return {id(r): self._open(r.into[:n], batch) for r in whole if (n := got[id(r)]) is not None}

        opened = await asyncio.to_thread(open_all) if whole else {}
        out: list[int | None] = []
        for r in requests:
            if r.byte_range is None:
                out.append(got[id(r)] if opened.get(id(r)) else None)
            else:
                out.append(await self._read_range(r.key, r.into, r.byte_range))
        return out

    async def _read_range(self, key: BlockKey, into: memoryview, byte_range: ByteRange) -> int | None:
        size = self.inner.size_of(key)
        if size is None:
            return None
        whole = _aligned(size)
        n = await self.inner.read_into(key, memoryview(whole))
        if n is None or not await asyncio.to_thread(self._open, whole[:n]):
            return None
        part = whole[byte_range.start : byte_range.start + byte_range.length]
        if part.nbytes != byte_range.length or len(into) < part.nbytes:
            raise ValueError(f"byte range {byte_range} does not fit the record or the destination")
        np.frombuffer(into, np.uint8)[: part.nbytes] = part
        return part.nbytes

    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        return (await self.read_many([ReadRequest(key, into, byte_range)]))[0]

    def _open_slab(self, got: list[int | None], dest: np.ndarray, record_bytes: int) -> list[int | None]:
        """Open the records read into ``dest`` (this call's slots only, read and not yet handed to
        anyone). Each record but the last borrows the first bytes of the next slot as room for its
        tag (``open_record``'s ``lent``: put back before the next record is opened), so its open
        is one AEAD call; bytes past ``dest`` are never touched (another read may own them)."""
        batch = self.cipher.batch()
        flat = dest.reshape(-1).view(np.uint8)
        out: list[int | None] = []
        for i, n in enumerate(got):
            if n is None:
                out.append(None)
                continue
            at = i * record_bytes
            lent = TAG_BYTES if at + n + TAG_BYTES <= flat.nbytes else 0
            out.append(n if self._open(flat[at : at + n + lent], batch, lent) else None)
        return out

    async def read_slab(self, keys: Sequence[BlockKey], dest: np.ndarray, record_bytes: int) -> list[int | None]:
        got = await self.inner.read_slab(keys, dest, record_bytes)
        return await asyncio.to_thread(self._open_slab, got, dest, record_bytes)

    def read_slab_now(self, keys: Sequence[BlockKey], dest: np.ndarray, record_bytes: int) -> list[int | None] | None:
        got = self.inner.read_slab_now(keys, dest, record_bytes)
        return None if got is None else self._open_slab(got, dest, record_bytes)

    def pin_records(self, keys: Sequence[BlockKey],
                    spill: Callable[[int], np.ndarray]) -> tuple[list[np.ndarray], RecordPin]:
        raise NotImplementedError("sealed records are opened in a copy, never read in place")

    # --- writes: seal a copy --------------------------------------------------------------------
    def _seal_all(self, items: list[tuple[BlockKey, memoryview]], buf: np.ndarray) -> list[tuple[BlockKey, memoryview]]:
        """Seal ``items`` back to back into ``buf`` (``TAG_BYTES`` longer than they are together).
        In order, on one thread: record i's tag scratch is the start of record i+1's slot, which
        sealing i+1 writes afterwards."""
        batch = self.cipher.batch()
        out: list[tuple[BlockKey, memoryview]] = []
        pos = 0
        for key, data in items:
            src = np.frombuffer(data, np.uint8)
            n = src.nbytes
            try:
                seal_record(buf[pos : pos + n + TAG_BYTES], batch, SEAL_BYTES, src=src, spare=TAG_BYTES)
            except TenantKeyUnavailable as e:
                self.seal_failures += 1
                log.warning("%s tier: block %s not written: %s", self.name, key.hex(), e)
                continue
            out.append((key, memoryview(buf[pos : pos + n])))
            pos += n
        return out

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview]]) -> None:
        todo = list(items)
        if not todo:
            return
        if self._seal_slots is None:
            self._seal_slots = asyncio.Semaphore(SEAL_AHEAD)
        async with self._seal_slots:  # bounds the sealed copies held, so their buffers are reused
            buf = self._buffers.take(sum(memoryview(d).nbytes for _, d in todo))
            try:
                sealed = await asyncio.to_thread(self._seal_all, todo, buf)
                if sealed:
                    await self.inner.write_many(sealed)
            finally:
                self._buffers.give(buf)

    async def write(self, key: BlockKey, data: memoryview) -> None:
        await self.write_many([(key, data)])

    async def delete(self, key: BlockKey) -> bool:
        return await self.inner.delete(key)

    async def delete_many(self, keys: Iterable[BlockKey]) -> int:
        return await self.inner.delete_many(keys)

    # --- the rest of the contract: the inner tier's -------------------------------------------------
    @property
    def retention(self) -> RetentionClasses:
        return self.inner.retention

    def configure_retention(self, *, max_share: float, clock: Callable[[], float]) -> RetentionClasses:
        return self.inner.configure_retention(max_share=max_share, clock=clock)

    def tenant_limit(self, tenant: str) -> int:
        return self.inner.tenant_limit(tenant)

    def tenant_usage(self) -> dict[bytes, tuple[int, int]] | None:
        return self.inner.tenant_usage()

    def erasures(self) -> dict[bytes, float]:
        return self.inner.erasures()

    async def erase_tenant(self, tenant: bytes) -> int:
        return await self.inner.erase_tenant(tenant)

    def set_residency_hook(self, hook: ResidencyHook | None) -> None:
        self.inner.set_residency_hook(hook)

    @property
    def residency_hook(self) -> ResidencyHook | None:
        return self.inner.residency_hook

    async def seal(self) -> SealedSegment | None:
        return await self.inner.seal()

    async def expire(self, now: float, max_bytes: int) -> TierExpiry:
        return await self.inner.expire(now, max_bytes)
