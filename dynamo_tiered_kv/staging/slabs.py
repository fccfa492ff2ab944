"""Fixed pool of page-aligned host slabs, allocated once and reused.

Each slab is an anonymous ``mmap`` (page aligned, so O_DIRECT and cuFile accept it). When CUDA
is available the slab is registered with ``cudaHostRegister`` (pinned), so GPU<->host copies
are DMA and can be asynchronous; otherwise the pages are pre-faulted (and ``mlock``-ed when
allowed) so the hot path never takes a page fault. Nothing on the hot path allocates.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..errors import StagingExhausted

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE


class Slab:
    """One page-aligned host buffer. ``array``/``tensor``/``view`` alias the same bytes."""

    __slots__ = ("_mmap", "address", "array", "index", "nbytes", "pinned", "tensor")

    def __init__(self, index: int, nbytes: int, pin: bool) -> None:
        self.index = index
        self.nbytes = nbytes
        self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.array[::PAGE] = 0  # pre-fault every page now, not on the hot path
        self.address = self.array.ctypes.data
        self.tensor = torch.from_numpy(self.array)
        self.pinned = False
        if pin:
            self.pinned = _cuda_host_register(self.address, nbytes)
        else:
            _try_mlock(self.address, nbytes)

    @property
    def view(self) -> memoryview:
        return memoryview(self.array)

    def release_memory(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        # Drop the numpy/torch aliases before closing the mapping.
        self.tensor = None  # type: ignore[assignment]
        self.array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a caller still holds a view; the mapping dies with it
            self._mmap.close()


def _cuda_host_register(addr: int, nbytes: int) -> bool:
    try:
        rc = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
    except Exception as e:  # pragma: no cover - GPU only
        log.warning("cudaHostRegister failed (%s); staging stays pageable", e)
        return False
    ok = int(rc) == 0 if not hasattr(rc, "value") else rc.value == 0
    if not ok:  # pragma: no cover - GPU only
        log.warning("cudaHostRegister returned %s; staging stays pageable", rc)
    return ok


_libc = None


def _try_mlock(addr: int, nbytes: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes)) == 0
    except Exception:  # pragma: no cover - platform without mlock
        return False


class StagingPool:
    """``num_slabs`` slabs of ``slab_bytes`` each; ``acquire`` hands one out, blocking up to a timeout.

    Threads: engine threads (offload), loading threads and the store's loop acquire and release; the
    free list and ``_closed`` change only under the condition ``_cv``. A slab handed out belongs to
    its holder alone until released. ``slabs``, ``slab_bytes`` and ``pinned`` are set once.
    ``pin=None`` pins when CUDA is available.
    """

    def __init__(self, slab_bytes: int, num_slabs: int, *, pin: bool | None = None) -> None:
        if slab_bytes <= 0 or num_slabs <= 0:
            raise ValueError("slab_bytes and num_slabs must be positive")
        slab_bytes = (slab_bytes + PAGE - 1) // PAGE * PAGE
        if pin is None:
            pin = torch.cuda.is_available()
        self.slab_bytes = slab_bytes
        self.slabs = [self._new_slab(i, slab_bytes, pin) for i in range(num_slabs)]
        self.pinned = all(s.pinned for s in self.slabs)
        self._free = list(reversed(self.slabs))
        self._cv = threading.Condition()
        self._closed = False

    def _new_slab(self, index: int, nbytes: int, pin: bool) -> Slab:
        return Slab(index, nbytes, pin)

    @property
    def free_count(self) -> int:
        with self._cv:
            return len(self._free)

    def try_acquire(self, timeout: float | None = 0.0) -> Slab | None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._free or self._closed, timeout=timeout):
                return None
            if self._closed:
                raise StagingExhausted("staging pool is closed")
            return self._free.pop()

    def acquire(self, timeout: float | None = None) -> Slab:
        slab = self.try_acquire(timeout)
        if slab is None:
            raise StagingExhausted(f"no staging slab free within {timeout}s ({len(self.slabs)} slabs)")
        return slab

    def release(self, slab: Slab) -> None:
        with self._cv:
            if slab in self._free:
                raise ValueError(f"slab {slab.index} released twice")
            self._free.append(slab)
            self._cv.notify()

    @contextmanager
    def slab(self, timeout: float | None = None) -> Iterator[Slab]:
        s = self.acquire(timeout)
        try:
            yield s
        finally:
            self.release(s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for s in self.slabs:
            s.release_memory()
