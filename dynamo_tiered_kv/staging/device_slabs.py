"""Staging slabs in device memory, for the GPU-direct (GDS) path to the SSD tier.

Records are gathered, checksummed and verified on the device (``device_codec``) in these slabs,
and NIXL GDS_MT moves them between the slabs and segment files without a host copy. The slabs
are allocated once and registered with NIXL once: VRAM registration maps GPU pages for DMA and
is far too slow for the hot path.

On a CPU-only machine a pool on ``device="cpu"`` gives page-aligned host slabs with the same
interface, so the whole device path (codec, NIXL descriptors, store wiring) runs in CI through
NIXL's POSIX backend; only the CUDA specifics wait for a GPU.

CUDA slabs are allocated on a thread of their own. ``torch.cuda.use_mem_pool`` routes only the
calling thread's allocations into its pool, and the store may be built while an engine has such a
pool active (vLLM's sleep mode allocates through a CuMem pool of VMM memory, which cuFile cannot
register for DMA and which sleep discards). Another thread's allocation comes from the default
caching allocator: plain ``cudaMalloc`` memory that GDS registers and that outlives sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .slabs import Slab, StagingPool


def synchronize(device: torch.device) -> None:
    """Wait for the work queued so far on this thread's current stream of ``device`` (no-op on CPU):
    an event, not a device-wide synchronize, so other streams (the engine's forward) are not
    waited for; a blocking event sleeps instead of spinning a core."""
    if device.type == "cuda":
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(device))
        ev.synchronize()


def _device_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _outside_thread_pools(alloc: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``alloc()`` on a fresh thread, so no memory pool the calling thread routes into applies."""
    out: list[torch.Tensor] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(alloc())
        except BaseException as e:  # re-raised on the caller's thread
            err.append(e)

    t = threading.Thread(target=run, name="dtkv-device-staging-alloc", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


class DeviceSlab:
    """One device buffer; ``address`` and ``device_id`` are what NIXL descriptors need."""

    __slots__ = ("_host", "address", "device_id", "index", "mem_type", "nbytes", "tensor")
    pinned = False  # device memory needs no pinning

    def __init__(self, index: int, nbytes: int, device: torch.device) -> None:
        self.index = index
        self.nbytes = nbytes
        self._host: Slab | None = None
        if device.type == "cpu":  # the CPU stand-in: a page-aligned host slab, as O_DIRECT needs
            self._host = Slab(index, nbytes, pin=False)
            self.tensor = self._host.tensor
            self.mem_type, self.device_id = "DRAM", 0
        else:  # cudaMalloc'd blocks this large are 2 MiB aligned, cuFile's preferred alignment
            self.tensor = _outside_thread_pools(lambda: _device_empty(nbytes, device))
            self.mem_type, self.device_id = "VRAM", device.index if device.index is not None else 0
        self.address = self.tensor.data_ptr()

    def release_memory(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        if self._host is not None:
            self._host.release_memory()


@dataclass(frozen=True, slots=True)
class DeviceSpan:
    """``nbytes`` of a device slab from ``offset``: one record's place in device memory."""

    slab: DeviceSlab
    offset: int
    nbytes: int

    @property
    def address(self) -> int:
        return self.slab.address + self.offset


class DeviceStagingPool(StagingPool):
    """``num_slabs`` device slabs of ``slab_bytes``; same acquire/release contract as ``StagingPool``."""

    def __init__(self, slab_bytes: int, num_slabs: int, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(slab_bytes, num_slabs, pin=False)

    def _new_slab(self, index: int, nbytes: int, pin: bool) -> DeviceSlab:  # type: ignore[override]
        return DeviceSlab(index, nbytes, self.device)
