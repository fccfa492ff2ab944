"""GPU-direct file I/O: NIXL moves records between registered device slabs and segment files.

With ``backend="GDS_MT"`` this is GPUDirect Storage (cuFile): the NVMe DMA engine reads and
writes GPU memory, and no host buffer or CPU copy is involved. ``backend="POSIX"`` over a CPU
``DeviceStagingPool`` drives the same descriptors through io_uring, which is how CI exercises
the path without a GPU.

Registration is the expensive part of GDS: device slabs are registered once (``register``),
segment files on first use and deregistered (``forget``) before the tier closes their fd.

Failure contract: every NIXL error surfaces as ``OSError`` after a bounded wait. The SSD tier
then detaches device I/O for good (log line, metric) and callers fall back to the host-bounce
path; what a failed read left in a slab is never trusted, because records read this way are
verified on the device before anything reaches the engine (``device_codec``).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ...blocks.codec import ALIGN
from ...staging.device_slabs import DeviceSlab, DeviceSpan, synchronize
from .io import _import_nixl, _wait

log = logging.getLogger(__name__)
_ids = itertools.count()
__all__ = ["DeviceIO", "DeviceSpan"]


class DeviceIO:
    """One NIXL agent with one file backend; thread-safe (calls are serialized).

    Args:
        backend: ``GDS_MT`` (GPUDirect Storage, needs the NVIDIA driver and libcufile) or
            ``POSIX`` (io_uring; host slabs only).
        params: backend parameters passed to ``create_backend``.
    """

    def __init__(self, backend: str = "GDS_MT", params: dict[str, str] | None = None) -> None:
        api = _import_nixl()
        self.backend = backend
        self._name = f"dtkv-gdio-{os.getpid()}-{next(_ids)}"
        self._ag = api.nixl_agent(self._name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        if params is None:
            params = {"use_uring": "true"} if backend == "POSIX" else {}
        self._ag.create_backend(backend, params)
        self._lock = threading.Lock()
        self._slabs: dict[int, object] = {}  # slab address -> registration
        self._descs: dict[int, tuple[int, int, int, str]] = {}  # slab address -> NIXL descriptor
        self._suspended: dict[int, tuple[int, int, int, str] | None] = {}  # deregistered for sleep
        self._mem_type: str | None = None
        self._device: torch.device | None = None
        self._files: dict[int, object] = {}  # fd -> registration

    def register(self, slabs: Iterable[DeviceSlab]) -> None:
        """Register device slabs once; every span later handed to ``write``/``read`` must lie in one."""
        with self._lock:
            for s in slabs:
                if s.address in self._slabs:
                    continue
                if self._mem_type not in (None, s.mem_type):
                    raise ValueError("all slabs of one DeviceIO must be of one memory type")
                self._mem_type = s.mem_type
                self._device = s.tensor.device
                desc = (s.address, s.nbytes, s.device_id, "")
                self._descs[s.address] = desc
                self._slabs[s.address] = self._ag.register_memory([desc], s.mem_type)

    def _file(self, fd: int) -> None:
        if fd not in self._files:
            self._files[fd] = self._ag.register_memory([(0, 0, fd, "")], "FILE")

    def forget(self, fd: int) -> None:
        """Deregister ``fd`` (call before closing it)."""
        with self._lock:
            reg = self._files.pop(fd, None)
            if reg is not None:
                try:
                    self._ag.deregister_memory(reg)
                except Exception as e:  # the fd is about to close anyway
                    log.debug("deregistering fd %d from NIXL failed: %s", fd, e)

    def write(self, fd: int, spans: Sequence[DeviceSpan], offset: int) -> None:
        """Write ``spans`` back to back into ``fd`` from ``offset``: one NIXL transfer."""
        self._xfer("WRITE", fd, spans, offset)

    def read(self, fd: int, spans: Sequence[DeviceSpan], offset: int) -> None:
        """Fill ``spans`` from ``fd``'s bytes at ``offset``, back to back: one NIXL transfer."""
        self._xfer("READ", fd, spans, offset)

    def _xfer(self, op: str, fd: int, spans: Sequence[DeviceSpan], offset: int) -> None:
        mem, files = [], []
        for addr, n, dev in _merge(spans):
            mem.append((addr, n, dev))
            files.append((offset, n, fd))
            offset += n
        ag = self._ag
        try:
            with self._lock:  # the lock guards the agent's calls, never the wait between them
                if self._mem_type is None or any(s.slab.address not in self._slabs for s in spans):
                    raise ValueError("DeviceIO transfer from a slab that was never registered")
                self._file(fd)
                h = ag.initialize_xfer(op, ag.get_xfer_descs(mem, self._mem_type), ag.get_xfer_descs(files, "FILE"),
                                       self._name)
            try:
                _wait(ag, h, self._lock)
            finally:
                with self._lock:
                    ag.release_xfer_handle(h)
        except (OSError, ValueError):
            raise
        except Exception as e:  # nixlBackendError and friends carry no errno
            raise OSError(errno.EIO, f"NIXL {self.backend} {op} failed: {type(e).__name__}: {e}") from e

    def suspend(self) -> None:
        """Deregister every device slab (GPU sleep: the memory behind them may be unmapped).

        The slabs' descriptors are kept, so ``resume`` registers the same addresses again (vLLM's
        sleep allocator maps memory back at the same virtual addresses). Transfers from a
        suspended slab fail with "never registered", which the SSD tier turns into a miss."""
        with self._lock:
            for addr, reg in list(self._slabs.items()):
                try:
                    self._ag.deregister_memory(reg)
                except Exception as e:
                    log.warning("NIXL deregistration of device slab %#x before sleep failed: %s", addr, e)
                self._suspended[addr] = self._descs.get(addr)
            self._slabs.clear()

    def resume(self) -> None:
        """Register again what ``suspend`` deregistered."""
        with self._lock:
            for addr, desc in list(self._suspended.items()):
                if desc is not None:
                    self._slabs[addr] = self._ag.register_memory([desc], self._mem_type)
            self._suspended.clear()

    def self_test(self, directory: Path) -> None:
        """Write 4 KiB from device memory to a file in ``directory`` and read it back through this
        path; raise ``OSError`` unless the bytes match. The start-up check behind "never a hang,
        never wrong data": creating a GDS_MT backend can succeed where registering a file or
        moving bytes fails (no nvidia-fs, an overlay filesystem, dynamo issue #6032)."""
        if self._device is None:
            raise ValueError("register the device slabs before the self-test")
        probe = DeviceSlab(-1, 2 * ALIGN, self._device)
        self.register([probe])
        path = directory / f".gdio-probe-{os.getpid()}-{id(self)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            probe.tensor[:ALIGN].copy_(torch.arange(ALIGN, device=self._device) % 251)
            probe.tensor[ALIGN:].zero_()
            synchronize(self._device)
            self.write(fd, [DeviceSpan(probe, 0, ALIGN)], 0)
            self.read(fd, [DeviceSpan(probe, ALIGN, ALIGN)], 0)
            synchronize(self._device)
            if not torch.equal(probe.tensor[:ALIGN], probe.tensor[ALIGN:]):
                raise OSError(errno.EIO, f"NIXL {self.backend} read back different bytes than it wrote")
        finally:
            self.forget(fd)
            os.close(fd)
            path.unlink(missing_ok=True)
            with self._lock:
                self._descs.pop(probe.address, None)
                reg = self._slabs.pop(probe.address, None)
                if reg is not None:
                    self._ag.deregister_memory(reg)
            probe.release_memory()

    def close(self) -> None:
        with self._lock:
            for reg in [*self._files.values(), *self._slabs.values()]:
                try:
                    self._ag.deregister_memory(reg)
                except Exception as e:
                    log.debug("NIXL deregistration at close failed: %s", e)
            self._files.clear()
            self._slabs.clear()


#: descriptor size cap: GDS_MT spreads descriptors over its threads, so a slab-sized run would be
#: one thread's serial I/O; a few MiB keeps every thread and NVMe queue busy (a multiple of 4 KiB)
MAX_DESC_BYTES = 4 << 20


def _merge(spans: Sequence[DeviceSpan], max_bytes: int = MAX_DESC_BYTES) -> list[tuple[int, int, int]]:
    """(address, length, device id) descriptors: spans adjacent in one slab are joined, and runs
    are cut at ``max_bytes``."""
    runs: list[list[int]] = []
    prev: DeviceSpan | None = None
    for s in spans:
        if s.offset < 0 or s.nbytes <= 0 or s.offset + s.nbytes > s.slab.nbytes:
            raise ValueError(f"span [{s.offset}, {s.offset + s.nbytes}) outside its {s.slab.nbytes}-byte slab")
        if prev is not None and prev.slab is s.slab and prev.offset + prev.nbytes == s.offset:
            runs[-1][1] += s.nbytes
        else:
            runs.append([s.address, s.nbytes, s.slab.device_id])
        prev = s
    out: list[tuple[int, int, int]] = []
    for addr, n, dev in runs:
        for off in range(0, n, max_bytes):
            out.append((addr + off, min(max_bytes, n - off), dev))
    return out
