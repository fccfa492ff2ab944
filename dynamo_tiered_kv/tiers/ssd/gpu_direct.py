"""The SSD tier's GPU-direct path (NIXL GDS_MT) while it works, and its one-way detach.

``GpuDirectLink`` holds the ``DeviceIO`` an SSD tier was given. Opening checks it round-trips real
bytes in the rank directory (over O_DIRECT files only); the first failed transfer afterwards,
from a reader or the writer, detaches it for good (log line, ``dtkv_ssd_gpu_direct_failures``)
and callers take the host-bounce path. ``dtkv_ssd_gpu_direct_active`` counts the tiers whose
link passed its check and is neither detached nor closed.

Threads: ``check`` runs on the writer thread while opening; ``failed`` on any reader or the
writer (its own lock: two failing at once detach and count once); ``current`` and ``forget``
anywhere (a reference read is atomic).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from . import metrics
from .gds import DeviceIO
from .io import PosixIO

log = logging.getLogger(__name__)


class GpuDirectLink:
    """The GPU-direct ``DeviceIO`` of one SSD tier until it fails (module docstring)."""

    def __init__(self, device_io: DeviceIO | None, rank_dir: Path) -> None:
        self._dio = device_io
        self._rank_dir = rank_dir
        self._lock = threading.Lock()
        self._counted = False  # whether this tier counts in dtkv_ssd_gpu_direct_active

    @property
    def current(self) -> DeviceIO | None:
        """The device path while attached (None: never given, refused at open, or failed)."""
        return self._dio

    def check(self, io: PosixIO) -> None:
        """Keep the path only if it round-trips real bytes in the rank directory now."""
        dio = self._dio
        if dio is None:
            return
        if not io.direct:
            log.warning("SSD tier %s: GPU-direct needs O_DIRECT files, this filesystem refuses them; "
                        "device records take the host-bounce path", self._rank_dir)
            self._dio = None
            return
        try:
            dio.self_test(self._rank_dir)
        except (OSError, ValueError) as e:
            log.warning("SSD tier %s: GPU-direct self-test through NIXL %s failed (%s); device records take the "
                        "host-bounce path", self._rank_dir, dio.backend, e)
            metrics.GPU_DIRECT_FAILURES.inc()
            self._dio = None
            return
        with self._lock:
            self._counted = True
        metrics.GPU_DIRECT_ACTIVE.inc()
        log.info("SSD tier %s: GPU-direct transfers through NIXL %s (self-test passed)", self._rank_dir, dio.backend)

    def failed(self, op: str, e: OSError) -> None:
        """A transfer failed: detach for good (its fd registrations die with its agent)."""
        with self._lock:
            if self._dio is None:
                return
            self._dio = None
        log.error("SSD tier %s: GPU-direct %s failed (%s); falling back to host bounce for good", self._rank_dir,
                  op, e)
        metrics.GPU_DIRECT_FAILURES.inc()
        self.release()

    def forget(self, fd: int) -> None:
        """Deregister a segment file before its descriptor closes."""
        dio = self._dio
        if dio is not None:
            dio.forget(fd)

    def release(self) -> None:
        """Stop counting this tier as GPU-direct (detach or close; idempotent)."""
        with self._lock:
            counted, self._counted = self._counted, False
        if counted:
            metrics.GPU_DIRECT_ACTIVE.dec()
