"""Sealing of the SSD tier's open segment: footer written and synced, entries handed over.

``Sealer`` seals on the writer thread (the only one that changes segments): when a segment is
full (the writer asks), when idle (``IdleSealer``, every ``idle_seal_s / 2``), when deleted
records lie in it (``seal_deleted``, so an expiry pass frees their bytes now), and on
``seal()``/close. A sealed segment goes to ``on_sealed`` (the flusher), then the reclaimer frees
what was deleted in it. A failed seal leaves the segment open with its records (``pending``) and
is retried by the next write, the idle sealer or close. Format: docs/SSD.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ...errors import TierUnavailable
from ..segments import SealedSegment, SegmentEntry
from . import metrics
from .io import aligned_buffer, write_extent
from .reclaim import Reclaimer
from .segment import ONE_TENANT, build_footer, footer_bytes
from .state import BOUNCE_BYTES, SegmentLogState, SegmentState

log = logging.getLogger(__name__)


class Sealer:
    """Seals the open segment (module docstring).

    Built by ``SSDTier`` with the shared ``SegmentLogState``, the ``Reclaimer`` (run after each
    seal; asked whether the open segment holds deleted records) and the ``on_sealed`` callback,
    which the owner may replace later (``SSDTier.on_sealed``). Threads: the writer thread only.
    """

    def __init__(self, state: SegmentLogState, reclaimer: Reclaimer,
                 on_sealed: Callable[[SealedSegment], None] | None) -> None:
        self._state = state
        self._reclaimer = reclaimer
        #: called on the writer thread with each newly sealed segment; keep it short
        self.on_sealed = on_sealed
        self._pending = False  # a seal of the open segment failed: retried by the next write or idle seal

    @property
    def pending(self) -> bool:
        """Whether a seal of the open segment failed and waits for a retry."""
        return self._pending

    def seal(self) -> SealedSegment | None:
        """Seal the open segment now (None when it holds nothing).

        Raises ``TierUnavailable`` if the footer cannot be written; the segment then stays open
        with its records, ``pending`` is set and a degrading errno makes the tier read-only.
        """
        st = self._state
        seg = st.open
        if seg is None or not seg.entries:
            return None
        now = time.time_ns()
        try:
            self._write_footer(seg, now)
        except OSError as e:  # the segment stays open with its records; the seal is retried later
            self._pending = True
            st.write_failed(seg, seg.data_bytes, e)
        self._pending = False
        entries = tuple(SegmentEntry(k, o, n) for k, o, n in seg.entries)
        with st.lock:
            seg.sealed = True
            seg.sealed_at = now / 1e9
            seg.entries = []
            st.open = None
        metrics.SEALED_SEGMENTS.inc()
        sealed = SealedSegment(st.segment_id(seg.seq), seg.path, seg.size, entries, seg.sealed_at)
        if self.on_sealed is not None:
            try:
                self.on_sealed(sealed)
            except Exception:
                log.exception("on_sealed callback failed for %s", sealed.segment_id)
        self._reclaimer.reclaim()  # dead records of the segment just sealed (and any deferred before)
        return sealed

    def seal_if_idle(self, max_age_s: float) -> SealedSegment | None:
        """Seal if nothing was appended for ``max_age_s`` seconds; a seal that failed earlier is
        retried at once, or once the read-only period after a device error (``write_retry_s``)
        is over."""
        st = self._state
        if st.open is None or st.disabled_reason:
            return None
        if st.readonly_reason:
            if not self._pending or time.monotonic() - st.readonly_at < st.write_retry_s:
                return None
        elif not self._pending and time.monotonic() - st.last_write < max_age_s:
            return None
        return self.seal()

    def seal_deleted(self) -> bool:
        """Seal the open segment if deleted records lie in it, so their bytes are freed now rather
        than once it fills (an expiry pass calls this at its end). Returns whether it sealed."""
        st = self._state
        seg = st.open
        if seg is None or not self._reclaimer.has_dead(seg.seq) or st.disabled_reason \
                or not self._reclaimer.punching:
            return False  # (without punching, sealing it would free nothing: it is the newest file)
        try:
            self.seal()  # reclaims on success
        except TierUnavailable as e:
            log.warning("SSD tier: cannot seal %s to free its deleted records: %s", seg.path.name, e)
            return False
        return True

    def _write_footer(self, seg: SegmentState, now_ns: int) -> None:
        st = self._state
        assert st.io is not None
        fb = footer_bytes(len(seg.entries))
        buf = st.write_bounce() if fb <= BOUNCE_BYTES else aligned_buffer(fb)
        footer = build_footer(st.rank, seg.seq, seg.data_bytes, now_ns, seg.entries, out=buf,
                              flags=ONE_TENANT if seg.one_tenant else 0)
        write_extent(st.io, seg.fd, seg.data_bytes, [footer], buf)
        st.io.sync(seg.fd)  # a seal is always durable: the flusher uploads what it sees


class IdleSealer:
    """A daemon thread that asks the writer thread to ``seal_if_idle`` every ``idle_s / 2``.

    Built and started by ``SSDTier.open`` with its ``Sealer`` and writer executor; ``stop`` is
    called from ``SSDTier.close`` (any thread) and waits for the thread a bounded time.
    """

    def __init__(self, sealer: Sealer, writer: ThreadPoolExecutor, idle_s: float, name: str) -> None:
        self._sealer = sealer
        self._writer = writer
        self._idle_s = idle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, self._idle_s / 2)):
            try:
                self._writer.submit(self._sealer.seal_if_idle, self._idle_s).result()
            except RuntimeError:  # executor shut down
                return
            except Exception as e:  # sealing failures already degraded the tier; keep the loop alive
                log.debug("idle seal failed: %s", e)

    def stop(self) -> None:
        """Ask the thread to end (no new submission after this returns to the loop)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)
