"""G2 host tier: an LRU cache of records in one preallocated (pinned when CUDA exists) arena.

The arena is cut into fixed chunks once; a record takes ``ceil(len / chunk)`` chunks from a free
list, so writes never allocate and the byte capacity is exact. Eviction is least recently used
(a read or write makes a key most recent). Copies are numpy memcpys; the tier holds a lock only
around index updates, and copies are done under it too since they are short and memory-bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import TierFull
from ..keys import BlockKey
from ..staging import Slab
from .base import ByteRange, Tier, TierCapabilities, TierUsage, check_range

DEFAULT_CHUNK_BYTES = 256 * 1024


class HostTier(Tier):
    name = "host"
    capabilities = TierCapabilities(medium="host", durable=False, shared=False)

    def __init__(
        self,
        capacity_bytes: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pin: bool | None = None,
        on_evict: Callable[[BlockKey], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0 or chunk_bytes <= 0:
            raise ValueError("capacity_bytes and chunk_bytes must be positive")
        import torch

        n_chunks = max(1, capacity_bytes // chunk_bytes)
        self._chunk = chunk_bytes
        self._capacity = n_chunks * chunk_bytes
        self._arena = Slab(0, self._capacity, torch.cuda.is_available() if pin is None else pin)
        self._chunks = self._arena.array.reshape(n_chunks, chunk_bytes)
        self._free: list[int] = list(range(n_chunks - 1, -1, -1))
        self._index: OrderedDict[BlockKey, tuple[int, list[int]]] = OrderedDict()  # key -> (len, chunks)
        self._used = 0
        self._lock = threading.Lock()
        self._on_evict = on_evict

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
        return TierUsage(self._capacity, self._used, len(self._index))

    # --- I/O (memory copies; cheap enough to run inline on the loop) --------------------------
    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        return self.read_sync(key, into, byte_range)

    def read_sync(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        dst = np.frombuffer(into, dtype=np.uint8)
        with self._lock:
            e = self._index.get(key)
            if e is None:
                return None
            length, chunks = e
            off, n = check_range(length, into, byte_range)
            self._index.move_to_end(key)
            c = self._chunk
            pos = 0
            while pos < n:
                ci, co = divmod(off + pos, c)
                take = min(c - co, n - pos)
                dst[pos : pos + take] = self._chunks[chunks[ci], co : co + take]
                pos += take
            return n

    async def write(self, key: BlockKey, data: memoryview) -> None:
        self.write_sync(key, data)

    def write_sync(self, key: BlockKey, data: memoryview) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        need = -(-src.nbytes // self._chunk) if src.nbytes else 0
        if need * self._chunk > self._capacity:
            raise TierFull(f"record of {src.nbytes} bytes exceeds host tier capacity {self._capacity}")
        evicted: list[BlockKey] = []
        with self._lock:
            self._drop(key)
            while len(self._free) < need:
                old, _ = next(iter(self._index.items()))
                self._drop(old)
                evicted.append(old)
            chunks = [self._free.pop() for _ in range(need)]
            c = self._chunk
            for i, ch in enumerate(chunks):
                part = src[i * c : (i + 1) * c]
                self._chunks[ch, : part.nbytes] = part
            self._index[key] = (src.nbytes, chunks)
            self._used += src.nbytes
        if self._on_evict is not None:
            for k in evicted:
                self._on_evict(k)

    def _drop(self, key: BlockKey) -> bool:
        e = self._index.pop(key, None)
        if e is None:
            return False
        self._free.extend(e[1])
        self._used -= e[0]
        return True

    async def delete(self, key: BlockKey) -> bool:
        with self._lock:
            return self._drop(key)

    async def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._used = 0
