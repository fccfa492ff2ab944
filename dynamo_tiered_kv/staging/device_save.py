"""Which device work of a GPU-direct save runs where, and when its device slab holds whole records:
the ordering of ``device_codec.begin_encode_on_device``, over the ``device_order.Ops`` interface.

A GPU-direct save builds its records in a device slab that NIXL GDS_MT then writes to the SSD.
The engine thread (``queue_gather``, between forward passes) only queues device work and returns;
the writer thread (``finish``) does the rest before the slab goes to a tier::

    engine:  forward ... [fwd] -------------------------------- wait(gathered) -> later kernels
    save:    ids H2D (pinned) -> wait(fwd) -> gather into slab -> [gathered]
    writer:  wait(gathered) -> padding, per-layer checksums -> sums D2H (pinned) -> [summed]
    host (writer thread): summed.synchronize() -> headers built in pinned memory
    writer:  headers H2D (pinned) -> into the records' header rows -> [done]
    host (writer thread): done.synchronize() -> the slab holds whole records; a GDS write may start

Later engine kernels (which may overwrite reused blocks) wait for the gather only. The checksums
are queued by the writer thread, not the engine thread: they only read the slab, and queuing them
from the engine thread would put their host-side cost (and any synchronizing copy inside them) on
the engine's critical path.

Streams: one save stream per CUDA device (``device_copy.save_stream``, shared by every engine thread
and by host-slab saves)
and one writer stream per writer thread and device (``writer_stream``), so one save's checksums
never queue behind a later save's wait for its forward. All are PyTorch pool streams, which do
not synchronize with the legacy default stream the engine's forward may run on.

CPU tensors (the stand-in CI runs) take ``inline_ops``: every step runs as it is queued.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .device_copy import ids_on, ops_for, save_stream, thread_stream
from .device_order import Ops, order_gather

__all__ = ["device_guard", "finish", "host_buffer", "ids_on", "ops_for", "queue_gather", "save_stream",
           "writer_stream"]


def writer_stream(device: torch.device) -> Any:
    """The calling writer thread's stream on ``device`` (created on first use)."""
    return thread_stream(device, "writer")


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` for CUDA (a tensor-parallel rank's work never lands on device 0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def host_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor for copies to and from ``device``: pinned for CUDA, so the copies are
    asynchronous DMA (PyTorch's pinned allocator keeps it until the copies that used it are done)."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=device.type == "cuda")


def queue_gather(ops: Ops, device: Any, save: Any, *, upload_ids: Callable[[], None],
                 gather: Callable[[], None]) -> Any:
    """Engine thread: ``device_order.order_gather`` on the save stream ``save``: the gather (engine
    blocks -> slab) after the forward that wrote the blocks; later engine work waits for it only.
    Returns the gather's event. Never blocks the host."""
    return order_gather(ops, device, save, upload_ids=upload_ids, gather=gather)


def finish(ops: Ops, writer: Any, gathered: Any, *, checksum: Callable[[], None], headers: Callable[[], None],
           upload: Callable[[], None]) -> None:
    """Writer thread: complete the records the gather behind ``gathered`` started, and return once
    they are whole in device memory.

    ``checksum`` queues the device work that reads the gathered payloads (and the copy of its
    results to pinned host memory); ``headers`` runs on the host once that copy is done;
    ``upload`` queues the headers' copy into the records. If any step raises, the device work
    already queued is waited for before the error propagates: the caller frees the slab then,
    and nothing of this save may still write into it.
    """
    queued = False
    try:
        with ops.use(writer):
            writer.wait_event(gathered)
            queued = True
            checksum()
            summed = ops.event()
            summed.record(writer)
        summed.synchronize()
        headers()
        with ops.use(writer):
            upload()
            done = ops.event()
            done.record(writer)
        done.synchronize()
    except BaseException:
        with contextlib.suppress(Exception):
            if not queued:
                gathered.synchronize()
            with ops.use(writer):
                drained = ops.event()
                drained.record(writer)
            drained.synchronize()
        raise
