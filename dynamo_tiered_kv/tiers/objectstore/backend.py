"""The object backend interface: a bucket of immutable, atomically published objects.

An ``ObjectBackend`` stores opaque objects under ``/``-separated names relative to its own
prefix. Contract shared by the backends (S3 and local directory):

* ``put_object`` publishes atomically: readers see either nothing or the whole object, never a
  prefix of it (S3 multipart completes in one step; the local directory renames a synced temp
  file). With ``if_absent`` it never replaces an existing object and reports whether it wrote.
* ``get_range`` scatters one contiguous byte range into caller-owned buffers with one request;
  a missing object, or one shorter than the range, is ``None`` (a miss), never partial data.
* Faults (server down, timeouts, resets, breaker open) raise ``TierUnavailable`` within a
  bounded time; callers treat that as a miss and recompute.

All methods are coroutines and may be called concurrently from one event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .latency import GetLatency


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object as listed: name relative to the backend prefix, size, unix mtime."""

    name: str
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class FileSource:
    """Upload ``length`` bytes of a local file starting at ``offset`` (read in parts, never whole)."""

    path: Path
    length: int
    offset: int = 0


Source = memoryview | bytes | bytearray | FileSource


def source_len(src: Source) -> int:
    return src.length if isinstance(src, FileSource) else memoryview(src).nbytes


@dataclass
class BackendStats:
    """Request counters (monotonic; read them as deltas)."""

    gets: int = 0
    puts: int = 0
    heads: int = 0
    lists: int = 0
    deletes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    retries: int = 0
    failures: int = 0  # operations that failed after all retries
    direct_gets: int = 0  # ranged GETs answered by the direct reader (S3)
    direct_fallbacks: int = 0  # times the direct reader gave up for good (S3)
    hedges_sent: int = 0  # second GETs sent for a range whose first GET was late to answer (S3)
    hedges_won: int = 0  # reads answered by that second GET (S3)


class ObjectBackend(abc.ABC):
    """Async object store with atomic publish, ranged reads and listing."""

    #: printable location without secrets, e.g. ``s3://bucket/prefix`` or ``file:///dir``
    url: str
    #: how the backend's recent ranged GETs answered (first byte, throughput), written on its loop;
    #: None for a backend that keeps no such window (a local directory). The tier sizes GETs by it.
    latency: GetLatency | None = None

    def __init__(self) -> None:
        self.stats = BackendStats()

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect (create clients, directories). Called once before use."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Idempotent."""

    @abc.abstractmethod
    async def put_object(self, name: str, source: Source, *, if_absent: bool = False) -> bool:
        """Publish ``source`` as object ``name`` atomically.

        Args:
            name: object name relative to the backend prefix.
            source: bytes in memory, or a ``FileSource`` read in parts.
            if_absent: do not replace an existing object (conditional create where the server
                supports it, HEAD-then-PUT otherwise; content-addressed names make the race benign).

        Returns:
            True if this call wrote the object, False if ``if_absent`` found it already there.

        Raises:
            TierUnavailable: the write failed after retries; nothing was published.
        """

    @abc.abstractmethod
    async def get_range(self, name: str, offset: int, dests: Sequence[memoryview]) -> int | None:
        """Read ``sum(len(d))`` bytes at ``offset`` with one request, filling ``dests`` in order.

        Returns:
            The number of bytes read (always the full range), or None if the object is missing
            or shorter than the range (the contents of ``dests`` are then unspecified).

        Raises:
            TierUnavailable: transport failure after retries, or the circuit breaker is open.
        """

    @abc.abstractmethod
    async def head(self, name: str) -> ObjectInfo | None:
        """Size and mtime of ``name``, or None if missing."""

    @abc.abstractmethod
    async def list(self, prefix: str = "", *, start_after: str = "") -> list[ObjectInfo]:
        """Every published object whose name starts with ``prefix`` (never temp or partial ones),
        in lexicographic (S3) order; with ``start_after`` only names after it (S3 ``StartAfter``)."""

    async def list_dirs(self, prefix: str) -> list[str]:
        """Names of the "directories" right under ``prefix`` (S3 ``CommonPrefixes``), without
        ``prefix`` or the trailing ``/``. Default: derived from a full listing."""
        return sorted({o.name[len(prefix):].split("/", 1)[0] for o in await self.list(prefix)
                       if "/" in o.name[len(prefix):]})

    @abc.abstractmethod
    async def delete(self, name: str) -> bool:
        """Delete ``name``; True if it existed (best effort on S3, which does not say)."""

    def expected_get_s(self, nbytes: int) -> float | None:
        """How long one ranged GET of ``nbytes`` is expected to take, from recent GETs; None when
        the backend does not know (default). Memory only."""
        return None

    async def get_bytes(self, name: str) -> bytes | None:
        """Whole small object (manifests) as bytes, or None if missing."""
        info = await self.head(name)
        if info is None:
            return None
        buf = bytearray(info.size)
        if info.size and await self.get_range(name, 0, [memoryview(buf)]) is None:
            return None
        return bytes(buf)

    async def abort_incomplete(self, older_than_s: float) -> int:
        """Discard unfinished uploads older than ``older_than_s``; returns how many. Default: none."""
        return 0


class Scatter:
    """Copies a stream of chunks into consecutive destination buffers."""

    __slots__ = ("_dests", "_i", "_pos", "written")

    def __init__(self, dests: Sequence[memoryview]) -> None:
        self._dests = [d.cast("B") if d.format != "B" or d.ndim != 1 else d for d in dests]
        self._i = 0
        self._pos = 0
        self.written = 0

    @property
    def capacity(self) -> int:
        return sum(d.nbytes for d in self._dests)

    def write(self, chunk: bytes | memoryview) -> None:
        src = memoryview(chunk)
        while src.nbytes:
            if self._i >= len(self._dests):
                raise ValueError("more bytes than the destination buffers hold")
            d = self._dests[self._i]
            take = min(d.nbytes - self._pos, src.nbytes)
            d[self._pos:self._pos + take] = src[:take]
            self._pos += take
            self.written += take
            src = src[take:]
            if self._pos == d.nbytes:
                self._i += 1
                self._pos = 0
