"""The batched copies between a CUDA engine's KV blocks and host record buffers, in the order
``device_order`` prescribes.

Save: engine blocks -> one contiguous device buffer (one gather launch) -> one copy into the host
slab. Restore: one contiguous copy of a chunk of verified records to the device -> one scatter
launch. Either way one copy per batch, not per block or layer, and never a host-synchronous one:
block ids travel through pinned memory, copies are ``non_blocking``, and the caller waits on the
returned event (off the engine thread for saves).

Restores run on a stream of their own per restore thread and device, under that device
(``torch.cuda.device``): a tensor-parallel rank's restore thread never launches on device 0.

Everything here also runs on CPU tensors (``pin`` off, a stand-in ``Ops``), which is how CI checks
the bytes and the ordering together.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .device_order import Ops, cuda_ops, order_restore, order_save

_side: dict[Any, Any] = {}  # one save stream per CUDA device, shared by every layout on it
_side_lock = threading.Lock()
_local = threading.local()  # per restore thread: {device: stream}


def _save_stream(device: torch.device) -> Any:
    with _side_lock:
        s = _side.get(device)
        if s is None:
            s = _side[device] = torch.cuda.Stream(device)
        return s


def _restore_stream(device: torch.device) -> Any:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    s = streams.get(device)
    if s is None:
        s = streams[device] = torch.cuda.Stream(device)
    return s


def _ids_on(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids on ``device`` without a host-synchronous copy: staged in pinned memory on CUDA."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type != "cuda":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def _device_ctx(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def queue_save(views: Sequence[torch.Tensor], device: torch.device, block_ids: Sequence[int], dst: torch.Tensor, *,
               record_bytes: int, header_bytes: int, layer_bytes: int, ops: Ops | None = None,
               side: Any = None) -> Any:
    """Queue the payloads of ``block_ids`` into records in ``dst`` (a flat uint8 host slab); returns
    the event to synchronize before reading ``dst``. Headers and checksums are the caller's."""
    from ..kernels import gather_records

    n = len(block_ids)
    ops = ops or cuda_ops()
    side = side if side is not None else _save_stream(device)
    st: dict[str, torch.Tensor] = {}

    def upload_ids() -> None:
        st["ids"] = _ids_on(block_ids, device)

    def gather() -> None:  # allocated on the side stream: the allocator reuses it only in that stream's order
        st["buf"] = torch.empty(n * record_bytes, dtype=torch.uint8, device=device)
        gather_records(views, st["ids"], st["buf"], record_bytes=record_bytes, header_bytes=header_bytes,
                       layer_bytes=layer_bytes)

    def download() -> None:
        dst[: n * record_bytes].copy_(st["buf"], non_blocking=True)

    with _device_ctx(device):
        return order_save(ops, device, side, upload_ids=upload_ids, gather=gather, download=download)


_scratch = threading.local()  # per restore thread: a pinned host buffer for records that are not back to back


def _pinned_scratch(nbytes: int, pin: bool) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if pin:
            buf = buf.pin_memory()
        _scratch.buf = buf
    return buf[:nbytes]


def restore_records(records: Sequence[np.ndarray], views: Sequence[torch.Tensor], device: torch.device,
                    block_ids: Sequence[int], *, record_bytes: int, header_bytes: int, layer_bytes: int,
                    chunk: np.ndarray | None = None, ops: Ops | None = None, stream: Any = None) -> None:
    """Scatter verified records into engine blocks ``block_ids`` and wait until they are there.

    ``chunk``: the records back to back in one host buffer (a staging slab), uploaded as is;
    otherwise ``records`` are packed into this thread's pinned scratch first. Only pass records
    whose checksums were verified on the host.
    """
    from ..kernels import scatter_records

    n = len(block_ids)
    if n == 0:
        return
    pin = device.type == "cuda"
    if chunk is None:
        host = _pinned_scratch(n * record_bytes, pin)
        packed = host.numpy().reshape(n, record_bytes)
        for i, r in enumerate(records):
            np.copyto(packed[i], r[:record_bytes])
    else:
        host = torch.from_numpy(chunk[: n * record_bytes])
    ops = ops or cuda_ops()
    st: dict[str, torch.Tensor] = {}
    with _device_ctx(device):
        stream = stream if stream is not None else _restore_stream(device)

        def upload() -> None:
            st["ids"] = _ids_on(block_ids, device)
            st["recs"] = host.to(device, non_blocking=True) if pin else host

        def scatter() -> None:
            scatter_records(st["recs"], views, st["ids"], record_bytes=record_bytes, header_bytes=header_bytes,
                            layer_bytes=layer_bytes)

        done = order_restore(ops, device, stream, upload=upload, scatter=scatter)
        done.synchronize()  # the pinned chunk and scratch are reusable, the blocks hold the records
