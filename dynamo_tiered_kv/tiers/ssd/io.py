"""Blocking I/O backends for segment files, and the probes that choose one.

Every backend reads and writes *extents*: a run of caller buffers that maps to one contiguous
byte range of a file, issued as one request (one ``pwritev``/``preadv`` or one NIXL descriptor
list), never a loop per block.

* ``NixlIO``   NIXL's POSIX backend (io_uring) on O_DIRECT file descriptors for writes. Page-aligned
  caller buffers go straight to the device; DRAM registration is per transfer (about 7 us here).
  Reads are a blocking ``preadv`` on the same descriptors (``NixlIO.nixl_reads``): a restore
  waits on them, and a NIXL read pays its setup and completion polling on top of the device.
* ``PosixIO(direct=True)``   plain ``os.pwritev``/``os.preadv`` on O_DIRECT descriptors.
* ``PosixIO(direct=False)``  buffered I/O; durability comes from ``fdatasync``. Used where the
  filesystem refuses O_DIRECT (ramfs, some overlayfs/FUSE mounts), with one warning.

O_DIRECT needs page-aligned addresses and lengths: unaligned buffers (``bytes`` in tests, torch
CPU tensors) bounce through an aligned scratch buffer in ``write_extent`` / ``read_extent``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...blocks.codec import ALIGN

log = logging.getLogger(__name__)
IOV_MAX = 1024
NIXL_TIMEOUT_S = 60.0
NIXL_DESC_BYTES = 1 << 20  # read descriptor size within one NIXL transfer (requests in the ring at once)
# Writes in large requests: one 32 MiB batch wrote at 0.68-0.71 of raw pwritev in 1 MiB requests on
# the 2-core dev VM's virtio disk, 0.77-0.79 in 4 MiB ones and 0.91-0.92 in one (`dtkv bench ssd --io nixl`).
NIXL_WRITE_DESC_BYTES = 32 << 20
WAIT_FIRST_GBPS = 2.0  # device rate assumed until transfers have measured it
POLL_MAX_S = 5e-4  # completion checks after the expected time: at least this often


def as_u8(buf: memoryview | np.ndarray | bytes | bytearray) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)


def address_of(buf: np.ndarray) -> int:
    return int(buf.__array_interface__["data"][0])


def is_aligned(buf: np.ndarray) -> bool:
    return address_of(buf) % ALIGN == 0 and buf.nbytes % ALIGN == 0


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted scratch buffer (anonymous mmap)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::mmap.PAGESIZE] = 0
    return a


class PosixIO:
    """pwritev/preadv, with O_DIRECT when ``direct``. Thread-safe (stateless syscalls)."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct
        self.name = "odirect" if direct else "buffered"

    def open(self, path: Path, create: bool = False) -> int:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o644)

    def close_fd(self, fd: int) -> None:
        os.close(fd)

    def write(self, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
        for i in range(0, len(bufs), IOV_MAX):
            part = list(bufs[i:i + IOV_MAX])
            offset = _pwritev_all(fd, part, offset)

    def read(self, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
        for i in range(0, len(bufs), IOV_MAX):
            part = list(bufs[i:i + IOV_MAX])
            want = sum(b.nbytes for b in part)
            got = os.preadv(fd, part, offset)
            if got != want:  # a segment never shrinks under a reader: short means damage
                raise OSError(errno.EIO, f"short read: {got} of {want} bytes at offset {offset}")
            offset += want

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self) -> None:
        pass


def _pwritev_all(fd: int, bufs: list[np.ndarray], offset: int) -> int:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {n} bytes at offset {offset}")
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return offset


def _import_nixl():
    """Import NIXL's API and keep its Python logging off stdout (it prints INFO there by default,
    which would corrupt ``--json`` output); NIXL_LOG_LEVEL still wins when set."""
    from nixl import _api

    nixl_log = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)
    for h in nixl_log.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)
    return _api


class NixlIO(PosixIO):
    """NIXL POSIX backend (io_uring) over O_DIRECT fds; one agent per process, calls serialized,
    transfers of several threads in flight together."""

    _agent = None
    _agent_lock = threading.Lock()
    #: reads through NIXL too. Off: a restore waits on its reads, and a NIXL read adds per-transfer
    #: setup (register, initialize, release, deregister under the agent lock) and completion polling
    #: by sleeps, whose wake-ups come late on a busy CPU; a blocking preadv wakes when the device is
    #: done. One 1 MiB read, 2-core dev VM, `python -m dynamo_tiered_kv.bench.restore.reads DIR`:
    #: 1.5 vs 1.2 ms at load average 11, 56 vs 6.6 ms with a restore bench running alongside
    #: (docs/BENCHMARKS.md, "Restore fixed costs").
    nixl_reads = False

    def __init__(self) -> None:
        super().__init__(direct=True)
        self.name = "nixl"
        self._agent_name, self._ag = self._get_agent()
        self._files: dict[int, object] = {}
        self._lock = threading.Lock()
        self._queue = DeviceQueue()
        self.fallbacks = 0  # transfers NIXL failed and pwritev/preadv redid

    @classmethod
    def _get_agent(cls) -> tuple[str, object]:
        with cls._agent_lock:
            if cls._agent is None or cls._agent[0] != os.getpid():
                api = _import_nixl()
                name = f"dtkv-ssd-{os.getpid()}"
                ag = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
                ag.create_backend("POSIX", {"use_uring": "true"})
                cls._agent = (os.getpid(), name, ag)
            return cls._agent[1], cls._agent[2]

    def open(self, path: Path, create: bool = False) -> int:
        fd = super().open(path, create)
        with self._lock:
            self._files[fd] = self._ag.register_memory([(0, 0, fd, "")], "FILE")
        return fd

    def close_fd(self, fd: int) -> None:
        with self._lock:
            reg = self._files.pop(fd, None)
            if reg is not None:
                self._ag.deregister_memory(reg)
        os.close(fd)

    def _xfer(self, op: str, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
        # One descriptor per NIXL_DESC_BYTES (writes: NIXL_WRITE_DESC_BYTES): one transfer puts
        # several requests in the ring.
        step = NIXL_WRITE_DESC_BYTES if op == "WRITE" else NIXL_DESC_BYTES
        mem, files = [], []
        total = 0
        for addr, n in _merge_contiguous(bufs):
            for a in range(0, n, step):
                m = min(step, n - a)
                mem.append((addr + a, m, 0))
                files.append((offset, m, fd))
                offset += m
            total += n
        ag = self._ag
        # The agent is called under the lock, one call at a time; the transfer itself runs without
        # it, so transfers of several threads are in flight together (the device's queue depth).
        with self._lock:
            reg = ag.register_memory([(a, n, 0, "") for a, n, _ in mem], "DRAM")
        try:
            with self._lock:
                h = ag.initialize_xfer(op, ag.get_xfer_descs(mem, "DRAM"), ag.get_xfer_descs(files, "FILE"),
                                       self._agent_name)
            posted = self._queue.post(total)
            try:
                _wait(ag, h, self._lock, posted.expect_s)
            finally:
                self._queue.done(posted)
                with self._lock:
                    ag.release_xfer_handle(h)
        finally:
            with self._lock:
                ag.deregister_memory(reg)

    def write(self, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
        try:
            self._xfer("WRITE", fd, bufs, offset)
        except Exception as e:  # NIXL reports no errno: redo with pwritev to fail (or succeed) precisely
            self._fell_back(e)
            super().write(fd, bufs, offset)

    def read(self, fd: int, bufs: Sequence[np.ndarray], offset: int) -> None:
        if not self.nixl_reads:
            super().read(fd, bufs, offset)
            return
        try:
            self._xfer("READ", fd, bufs, offset)
        except Exception as e:
            self._fell_back(e)
            super().read(fd, bufs, offset)

    def _fell_back(self, e: Exception) -> None:
        self.fallbacks += 1
        if self.fallbacks == 1:
            log.warning("NIXL transfer failed (%s: %s); retrying with pwritev/preadv", type(e).__name__, e)


def _merge_contiguous(bufs: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    """(address, length) spans, joining buffers adjacent in memory: a run into one slab is one descriptor."""
    out: list[tuple[int, int]] = []
    for b in bufs:
        a = address_of(b)
        if out and out[-1][0] + out[-1][1] == a:
            out[-1] = (out[-1][0], out[-1][1] + b.nbytes)
        else:
            out.append((a, b.nbytes))
    return out


@dataclass
class Posted:
    """One transfer on a ``DeviceQueue``: its bytes, the bytes in flight with it, when it was posted."""

    nbytes: int
    ahead: int
    start: float
    expect_s: float


class DeviceQueue:
    """Bytes in flight on one agent and the rate the device completes them at (EWMA of finished
    transfers), so a transfer's first completion check comes when the bytes ahead of it, its own
    included, should be done. Sixteen 2 MiB reads sharing a 2 GB/s device each finish after
    ~16 ms, not their own 1 ms: checked from their own size on, each took ~13 wake-ups of its
    thread (a third of an SSD restore's CPU on a 2-core engine)."""

    def __init__(self, gbps: float = WAIT_FIRST_GBPS) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self.rate = gbps * 1e9  # bytes/s

    def post(self, nbytes: int) -> Posted:
        with self._lock:
            self._bytes += nbytes
            ahead = self._bytes
            rate = self.rate
        return Posted(nbytes, ahead, time.monotonic(), ahead / rate)

    def done(self, p: Posted) -> None:
        elapsed = time.monotonic() - p.start
        with self._lock:
            self._bytes -= p.nbytes
            if p.nbytes >= 1 << 20 and elapsed > 0:  # small transfers time the syscalls, not the device
                sample = min(max(p.ahead / elapsed, 1e8), 1e11)
                self.rate += 0.2 * (sample - self.rate)


def _wait(ag: object, h: object, lock: threading.Lock | None = None, expect_s: float = 0.0) -> None:
    """Post transfer ``h`` and wait for it; ``lock`` (if given) is held around each agent call only.

    The first check comes at 0.8 ``expect_s`` (when the transfer should be done), later ones every
    1/8 of the time waited so far (20 us to POLL_MAX_S): a handful of wake-ups per transfer.
    """
    guard = lock if lock is not None else contextlib.nullcontext()
    with guard:
        st = ag.transfer(h)  # type: ignore[attr-defined]
    start = time.monotonic()
    first = 0.8 * expect_s
    while st == "PROC":
        waited = time.monotonic() - start
        if waited > NIXL_TIMEOUT_S:
            raise OSError(errno.ETIMEDOUT, "NIXL transfer did not complete")
        if waited < first:
            time.sleep(first - waited)
        elif waited > 5e-5:  # small transfers: spin briefly (they finish in tens of us)
            time.sleep(min(POLL_MAX_S, max(2e-5, waited / 8)))
        with guard:
            st = ag.check_xfer_state(h)  # type: ignore[attr-defined]
    if st != "DONE":
        raise OSError(errno.EIO, f"NIXL transfer ended in state {st}")


# --- extents with bouncing -------------------------------------------------------------------
def write_extent(io: PosixIO, fd: int, offset: int, srcs: Sequence[np.ndarray], bounce: np.ndarray) -> None:
    """Write ``srcs`` back to back at ``offset`` (aligned) as few requests as the bounce allows."""
    if not io.direct or all(is_aligned(s) for s in srcs):
        io.write(fd, srcs, offset)
        return
    fill = 0
    for s in srcs:
        pos = 0
        while pos < s.nbytes:
            take = min(bounce.nbytes - fill, s.nbytes - pos)
            bounce[fill:fill + take] = s[pos:pos + take]
            fill += take
            pos += take
            if fill == bounce.nbytes:
                io.write(fd, [bounce], offset)
                offset += fill
                fill = 0
    if fill:
        io.write(fd, [bounce[:fill]], offset)  # records are 4 KiB multiples: fill stays aligned


def read_extent(io: PosixIO, fd: int, offset: int, dsts: Sequence[np.ndarray], bounce: np.ndarray) -> None:
    """Fill ``dsts`` from the file bytes starting at ``offset``, back to back."""
    total = sum(d.nbytes for d in dsts)
    if not io.direct or (offset % ALIGN == 0 and all(is_aligned(d) for d in dsts)):
        io.read(fd, dsts, offset)
        return
    start = offset - offset % ALIGN
    end = -(-(offset + total) // ALIGN) * ALIGN
    di, dpos = 0, 0
    pos = start
    while pos < end:
        n = min(bounce.nbytes, end - pos)
        io.read(fd, [bounce[:n]], pos)
        lo = max(offset, pos)
        hi = min(offset + total, pos + n)
        while lo < hi:
            d = dsts[di]
            take = min(d.nbytes - dpos, hi - lo)
            d[dpos:dpos + take] = bounce[lo - pos:lo - pos + take]
            dpos += take
            lo += take
            if dpos == d.nbytes:
                di, dpos = di + 1, 0
        pos += n


# --- probes ----------------------------------------------------------------------------------
def probe_odirect(directory: Path) -> bool:
    """Whether ``directory``'s filesystem accepts an aligned O_DIRECT write and read."""
    path = directory / f".odirect-probe-{os.getpid()}"
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as e:  # EINVAL: refused; anything else (ENOSPC on a full disk) is not about O_DIRECT
        return e.errno != errno.EINVAL
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def _probe_nixl(directory: Path) -> NixlIO:
    io = NixlIO()
    path = directory / f".nixl-probe-{os.getpid()}"
    buf = aligned_buffer(2 * ALIGN)
    buf[:ALIGN] = 0xA5
    fd = io.open(path, create=not path.exists())
    try:
        io.write(fd, [buf[:ALIGN]], 0)
        io.read(fd, [buf[ALIGN:]], 0)
        if not np.array_equal(buf[:ALIGN], buf[ALIGN:]):
            raise OSError(errno.EIO, "NIXL probe read back different bytes")
    finally:
        io.close_fd(fd)
        path.unlink(missing_ok=True)
    return io


def select_io(directory: Path, mode: str) -> PosixIO:
    """Pick the I/O path for ``directory``: ``auto`` tries nixl, then odirect, then buffered.

    An explicit mode that cannot work falls back the same way with a warning, never an error:
    a slower path beats no SSD tier.
    """
    if mode not in ("auto", "nixl", "odirect", "buffered"):
        raise ValueError(f"io must be auto|nixl|odirect|buffered, got {mode!r}")
    if mode == "buffered":
        return PosixIO(direct=False)
    if not probe_odirect(directory):
        log.warning("SSD tier: %s refuses O_DIRECT (tmpfs/ramfs/overlayfs?); using buffered I/O + fdatasync",
                    directory)
        return PosixIO(direct=False)
    if mode in ("auto", "nixl"):
        try:
            return _probe_nixl(directory)
        except Exception as e:  # ImportError, nixlBackendError, OSError: all mean "not here"
            (log.warning if mode == "nixl" else log.info)(
                "SSD tier: NIXL POSIX unavailable (%s: %s); using O_DIRECT pwritev/preadv", type(e).__name__, e)
    return PosixIO(direct=True)
