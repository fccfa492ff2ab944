"""Staging slabs in device memory, for the GPU-direct (GDS) path to the SSD tier.

Records are gathered, checksummed and verified on the device (``device_codec``) in these slabs,
and NIXL GDS_MT moves them between the slabs and segment files without a host copy. The slabs
are allocated once and registered with NIXL once: VRAM registration maps GPU pages for DMA and
is far too slow for the hot path.

On a CPU-only machine a pool on ``device="cpu"`` gives page-aligned host slabs with the same
interface, so the whole device path (codec, NIXL descriptors, store wiring) runs in CI through
NIXL's POSIX backend; only the CUDA specifics wait for a GPU.
"""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from .staging import StagingPool


class DeviceSlab:
    """One device buffer; ``address`` and ``device_id`` are what NIXL descriptors need."""

    __slots__ = ("_mmap", "address", "device_id", "index", "mem_type", "nbytes", "tensor")

    def __init__(self, index: int, nbytes: int, device: torch.device) -> None:
        self.index = index
        self.nbytes = nbytes
        self._mmap: mmap.mmap | None = None
        if device.type == "cpu":  # page aligned, as O_DIRECT needs
            self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            arr = np.frombuffer(self._mmap, dtype=np.uint8)
            arr[::mmap.PAGESIZE] = 0
            self.tensor = torch.from_numpy(arr)
            self.mem_type, self.device_id = "DRAM", 0
        else:  # cudaMalloc'd blocks this large are 2 MiB aligned, cuFile's preferred alignment
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.mem_type, self.device_id = "VRAM", device.index if device.index is not None else 0
        self.address = self.tensor.data_ptr()

    def release_memory(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view; the mapping dies with it
                self._mmap.close()


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
        if slab_bytes <= 0 or num_slabs <= 0:
            raise ValueError("slab_bytes and num_slabs must be positive")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.slab_bytes = (slab_bytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.pinned = False
        self._setup([DeviceSlab(i, self.slab_bytes, self.device) for i in range(num_slabs)])
