"""Opening and closing an SSD tier's rank directory: lock, I/O path, recovery, index rebuild.

``SegmentLogLifecycle.open`` takes ``flock(LOCK_EX | LOCK_NB)`` on ``rank-NNN/LOCK``, picks the
I/O path, probes GPUDirect (once per filesystem) and the GPU-direct link, recovers every segment
(``recovery.recover_segments``), rebuilds the index (with each record's tenant, for the tenant
ledger) newest location first with the tombstone log applied, and writes the tombstones a crash
left out (a superseded copy that would otherwise come back). It never raises for environmental
faults: the tier is disabled (``disabled_reason``, ``dtkv_ssd_disabled``) and serves nothing.
``close`` seals the open segment, forgets every segment and releases the lock. Crash contract:
docs/SSD.md section 4; concurrency rule: section 5.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os

from ...blocks.tenant import DEFAULT_TENANT
from ...errors import TierUnavailable
from . import metrics
from .gds_probe import GdsVerdict, gds_verdict
from .io import select_io
from .quarantine import highest_quarantined_seq, quarantine
from .reclaim import Reclaimer
from .recovery import load_tombstones, recover_segments
from .sealing import Sealer
from .segment import LOCK_FILE, list_segments
from .state import SegmentLogState, SegmentState
from .tombstones import TombstoneLog

log = logging.getLogger(__name__)


class SegmentLogLifecycle:
    """Opens and closes the rank directory (module docstring).

    Built by ``SSDTier`` with the shared ``SegmentLogState`` (filled by recovery), the I/O mode
    asked for, and the parts opening and closing reach: the ``TombstoneLog`` (opened after
    recovery, closed last), the ``Reclaimer`` (segments recovery found without a live record)
    and the ``Sealer`` (close seals). Threads: the writer thread (``open``/``close`` run there).
    """

    def __init__(self, state: SegmentLogState, io_mode: str, *, tombstones: TombstoneLog, reclaimer: Reclaimer,
                 sealer: Sealer) -> None:
        self._state = state
        self._io_mode = io_mode
        self._tombstones = tombstones
        self._reclaimer = reclaimer
        self._sealer = sealer
        self._lock_fd: int | None = None
        #: the GPUDirect Storage verdict for the rank directory's filesystem (set by ``open``)
        self.gds = GdsVerdict(False, "not probed")

    def open(self) -> None:
        """Lock, choose the I/O path, recover; disable the tier on an environmental fault."""
        st = self._state
        try:
            st.rank_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(st.rank_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._disable(f"{st.rank_dir} is locked by another process (one writer per rank directory)")
                return
            st.io = select_io(st.rank_dir, self._io_mode)
            self._reclaimer.probe_fs_block()
            metrics.IO_PATH.labels(st.io.name).set(1)
            self.gds = gds_verdict(st.rank_dir)  # the self-test file goes where this tier's segments go
            st.gpu.check(st.io)
            superseded = self._recover()
            self._tombstones.open()
            if superseded:
                self._tombstones.append(superseded)
            self._reclaimer.reclaim()  # segments recovery found without a live record
        except OSError as e:
            self._disable(f"cannot use {st.rank_dir}: {e}")
            self._drop_state()  # a half-recovered index must not serve anything

    def close(self) -> None:
        """Seal the open segment, forget every segment, close the logs and release the lock."""
        if self._state.disabled_reason is None:  # even read-only: the footer may still fit after a failed write
            with contextlib.suppress(TierUnavailable):
                self._sealer.seal()
        self._drop_state()
        self._tombstones.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the lock fd releases the flock
            self._lock_fd = None

    def _drop_state(self) -> None:
        self._state.drop_all()
        self._reclaimer.clear()

    def _disable(self, reason: str) -> None:
        log.error("SSD tier disabled (no SSD tier): %s", reason)
        self._state.disabled_reason = reason
        metrics.DISABLED.inc()  # one per disabled tier; SSDTier.close takes it back
        metrics.DEGRADED.labels("disabled").inc()

    def _recover(self) -> list[tuple[int, int, bytes]]:
        """Load every segment into the state; returns the superseded locations that still need
        a tombstone ``(seq, offset, key)``."""
        st = self._state
        assert st.io is not None
        seen = list_segments(st.rank_dir)
        # never reuse a seq, even of a removed or quarantined file (the object tier may hold it)
        st.next_seq = max(seen[-1][0] if seen else 0, highest_quarantined_seq(st.rank_dir)) + 1
        recovered = recover_segments(st.rank_dir, st.rank)
        dead = load_tombstones(st.rank_dir, {r.seq for r in recovered})
        self._tombstones.note_recovered(dead)
        superseded: list[tuple[int, int, bytes]] = []
        for r in recovered:
            try:
                fd = st.io.open(r.path)
            except OSError as e:  # one unreadable file must not turn the whole tier off
                quarantine(r.path, f"cannot open it for I/O: {e}")
                continue
            seg = SegmentState(r.seq, r.path, fd, r.data_bytes, r.size, sealed=True,
                               flushed=r.flushed, sealed_at=r.sealed_at_ns / 1e9, last_used=st.next_tick())
            entries = list(zip(r.entries["key"].tolist(), r.entries["offset"].tolist(),
                               r.entries["length"].tolist(), r.tenants))
            # the owner (charged the footer and dead bytes): the tenant of its first live record
            owner = next((t for _, off, _, t in entries if (r.seq, off) not in dead), DEFAULT_TENANT)
            st.add_segment_locked(seg, owner)  # (no reader yet: the lock is not needed while opening)
            if r.seal_error and st.readonly_reason is None:
                st.readonly_reason = f"cannot seal recovered {r.path.name}: {r.seal_error}"
                metrics.DEGRADED.labels("recovery").inc()
            for key, off, length, tenant in entries:
                # Entries arrive in write order, so the newest location decides: a tombstone on
                # it means the key was deleted after every older copy was written.
                if (r.seq, off) in dead:
                    st.pop_locked(key)
                else:
                    old = st.put_locked(key, seg, off, length, tenant)
                    if old is not None:  # a crash beat the overwrite's tombstone: write it now,
                        superseded.append((old[0], old[1], key))  # or evicting the new copy revives this one
        self._reclaimer.note_empty_segments(r.seq for r in recovered)
        metrics.USED_BYTES.set(st.used)
        log.info("SSD tier %s: recovered %d segments, %d blocks, %d bytes; io=%s", st.rank_dir,
                 len(recovered), len(st.index), st.used, st.io_path)
        return superseded
