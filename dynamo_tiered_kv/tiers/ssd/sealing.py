"""Sealing of the SSD tier's open segment: footer written and synced, entries handed over.

``SealingMixin`` is mixed into ``SSDTier`` only and uses its open segment, lock, writer thread
and I/O path; it is split out to keep ``tier.py`` short. Seals run on the writer thread (the
only one that changes segments): when a segment is full, when idle (``idle_seal_s``), and on
``seal()``/close. A sealed segment goes to ``on_sealed`` (the flusher). Format: docs/SSD.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ..segments import SealedSegment, SegmentEntry
from . import metrics
from .flushing import SegmentState
from .io import PosixIO, aligned_buffer, write_extent
from .reads import BOUNCE_BYTES
from .segment import build_footer, footer_bytes

log = logging.getLogger(__name__)


class SealingMixin:
    """``seal``, ``seal_if_idle`` and the idle-seal loop of ``SSDTier``."""

    rank: int
    disabled_reason: str | None
    readonly_reason: str | None
    on_sealed: Callable[[SealedSegment], None] | None
    _open: SegmentState | None
    _lock: threading.Lock
    _writer: ThreadPoolExecutor
    _io: PosixIO | None
    _stop: threading.Event
    _seal_pending: bool
    _readonly_at: float
    _write_retry_s: float
    _last_write: float
    _idle_seal_s: float | None

    if TYPE_CHECKING:  # SSDTier's (and SegmentSourceMixin's); declared here for type checkers only
        def _write_failed(self, seg: SegmentState, offset: int, e: OSError) -> None: ...
        def _bounce(self) -> np.ndarray: ...
        def _segment_id(self, seq: int) -> str: ...
        def _reclaim_sync(self) -> None: ...

    async def seal(self) -> SealedSegment | None:
        """Seal the open segment now (None when it holds nothing)."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._seal_sync)

    async def seal_if_idle(self, max_age_s: float) -> SealedSegment | None:
        """Seal the open segment if nothing was appended for ``max_age_s`` seconds."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._seal_if_idle_sync, max_age_s)

    def _seal_if_idle_sync(self, max_age_s: float) -> SealedSegment | None:
        """Seal when idle; a seal that failed earlier is retried at once, or once the read-only
        period after a device error (``write_retry_s``) is over."""
        if self._open is None or self.disabled_reason:
            return None
        if self.readonly_reason:
            if not self._seal_pending or time.monotonic() - self._readonly_at < self._write_retry_s:
                return None
        elif not self._seal_pending and time.monotonic() - self._last_write < max_age_s:
            return None
        return self._seal_sync()

    def _idle_loop(self) -> None:
        assert self._idle_seal_s
        while not self._stop.wait(max(0.05, self._idle_seal_s / 2)):
            try:
                self._writer.submit(self._seal_if_idle_sync, self._idle_seal_s).result()
            except RuntimeError:  # executor shut down
                return
            except Exception as e:  # sealing failures already degraded the tier; keep the loop alive
                log.debug("idle seal failed: %s", e)

    def _seal_sync(self) -> SealedSegment | None:
        seg = self._open
        if seg is None or not seg.entries:
            return None
        now = time.time_ns()
        try:
            self._write_footer(seg, now)
        except OSError as e:  # the segment stays open with its records; the seal is retried later
            self._seal_pending = True
            self._write_failed(seg, seg.data_bytes, e)
        self._seal_pending = False
        entries = tuple(SegmentEntry(k, o, n) for k, o, n in seg.entries)
        with self._lock:
            seg.sealed = True
            seg.sealed_at = now / 1e9
            seg.entries = []
            self._open = None
        metrics.SEALED_SEGMENTS.inc()
        sealed = SealedSegment(self._segment_id(seg.seq), seg.path, seg.size, entries, seg.sealed_at)
        if self.on_sealed is not None:
            try:
                self.on_sealed(sealed)
            except Exception:
                log.exception("on_sealed callback failed for %s", sealed.segment_id)
        self._reclaim_sync()  # dead records of the segment just sealed (and any deferred before)
        return sealed

    def _write_footer(self, seg: SegmentState, now_ns: int) -> None:
        assert self._io is not None
        fb = footer_bytes(len(seg.entries))
        buf = self._bounce() if fb <= BOUNCE_BYTES else aligned_buffer(fb)
        footer = build_footer(self.rank, seg.seq, seg.data_bytes, now_ns, seg.entries, out=buf)
        write_extent(self._io, seg.fd, seg.data_bytes, [footer], buf)
        self._io.sync(seg.fd)  # a seal is always durable: the flusher uploads what it sees
