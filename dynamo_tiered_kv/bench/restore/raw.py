"""Raw ceilings for ``dtkv bench restore``: the same bytes the store restored, read without the store.

* ``locate``: where the records of a restore live (SSD segment file ranges, object names and ranges);
* ``odirect_read``: ``preadv`` of those ranges with O_DIRECT, ``depth`` requests of ``chunk`` bytes
  in flight (one thread each; the syscalls release the GIL);
* ``S3Raw.read``: parallel ranged GETs of those ranges, ``depth`` in flight, ``chunk`` bytes each;
* ``memcpy``: one copy of ``nbytes`` between two preallocated buffers (the host tier's ceiling).
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ...tiers.ssd.io import aligned_buffer

ALIGN = 4096
Extent = tuple[str, int, int]  # (file path or object name, offset, length)


def locate(store: Any, keys: list[Any], tier_name: str) -> list[Extent]:
    """(file or object, offset, length) of each of ``keys`` in tier ``tier_name`` (missing keys skipped)."""
    tier = next(t for t in store.tiers if t.name == tier_name)
    out: list[Extent] = []
    for k in keys:
        if tier_name == "ssd":
            loc = tier.location(k)
            if loc is not None:
                path, off, ln = loc
                out.append((str(path), off, ln))
        elif tier_name == "object":
            where = tier.location(k)
            if where is not None:
                name, e = where
                b = tier.backend
                while hasattr(b, "base") and hasattr(b, "_n"):  # namespace views: the backend they prefix
                    name, b = b._n(name), b.base
                out.append((str(b._path(name)) if hasattr(b, "root") else b._key(name), e.offset, e.length))
    return out


def merge(extents: list[Extent]) -> list[Extent]:
    """Merge byte-contiguous ranges of one file and align them to 4 KiB (O_DIRECT)."""
    out: list[list[Any]] = []
    for name, off, ln in sorted(extents):
        if out and out[-1][0] == name and out[-1][1] + out[-1][2] >= off:
            out[-1][2] = max(out[-1][2], off + ln - out[-1][1])
        else:
            out.append([name, off, ln])
    res: list[Extent] = []
    for name, off, ln in out:
        a = off - off % ALIGN
        res.append((name, a, -(-(off + ln - a) // ALIGN) * ALIGN))
    return res


def split(extents: list[Extent], chunk: int) -> list[Extent]:
    return [(n, o + i, min(chunk, ln - i)) for n, o, ln in extents for i in range(0, ln, chunk)]


def odirect_read(extents: list[Extent], chunk: int, depth: int, dst: np.ndarray | None = None) -> float:
    """Seconds to read ``extents`` with O_DIRECT ``preadv``, ``depth`` requests of ``chunk`` in flight."""
    parts = split(merge(extents), chunk)
    total = sum(p[2] for p in parts)
    if dst is None or dst.nbytes < total:
        dst = aligned_buffer(total)
    fds = {n: os.open(n, os.O_RDONLY | os.O_DIRECT) for n in {p[0] for p in parts}}
    offs = np.cumsum([0] + [p[2] for p in parts]).tolist()

    def one(i: int) -> None:
        n, off, ln = parts[i]
        if os.preadv(fds[n], [dst[offs[i]:offs[i] + ln]], off) != ln:
            raise OSError(f"short raw read of {n}")

    try:
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(lambda i: None, range(depth)))  # threads started outside the timing
            t = time.perf_counter()
            list(pool.map(one, range(len(parts))))
            return time.perf_counter() - t
    finally:
        for fd in fds.values():
            os.close(fd)


def memcpy(nbytes: int, repeats: int = 3) -> float:
    """Best of ``repeats`` copies of ``nbytes`` between two buffers already touched (seconds)."""
    a, b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return best


class S3Raw:
    """Raw parallel ranged GETs with aiobotocore on a loop of its own (client made once, outside timings)."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.bucket = bucket
        env = os.environ
        self._kw = {"endpoint_url": endpoint, "aws_access_key_id": env.get("DTKV_S3_ACCESS_KEY", "testing"),
                    "aws_secret_access_key": env.get("DTKV_S3_SECRET_KEY", "testing"),
                    "region_name": env.get("DTKV_S3_REGION", "us-east-1")}
        self.client = self.loop.run_until_complete(self._open())

    async def _open(self) -> Any:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        self._cm = get_session().create_client("s3", config=AioConfig(max_pool_connections=64), **self._kw)
        return await self._cm.__aenter__()

    def read(self, extents: list[Extent], chunk: int, depth: int) -> float:
        """Seconds to GET every range of ``extents`` in ``chunk``-byte ranged GETs, ``depth`` in flight."""
        from ..s3 import _raw_get

        parts = split(merge(extents), chunk)

        async def go() -> float:
            sem = asyncio.Semaphore(depth)

            async def one(p: Extent) -> int:
                async with sem:
                    return await _raw_get(self.client, self.bucket, p[0], p[1], p[2])

            t = time.perf_counter()
            await asyncio.gather(*(one(p) for p in parts))
            return time.perf_counter() - t

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self._cm.__aexit__(None, None, None))
        self.loop.close()
