"""Offload encoding split in two: what the engine thread must do, and what a background thread may.

``wait_for_save`` runs on the engine thread between forward passes, and after it returns vLLM may
hand the saved blocks to another request. On a CUDA engine the engine thread therefore only queues
work (``device_copy.queue_save``, ordered by ``device_order.order_save``): on a side stream, after
the forward that wrote the blocks, one gather into a contiguous device buffer and one copy of it
into the pinned host slab; the engine's stream waits for the gather (a GPU-side dependency: the
next kernel that could overwrite a reused block starts after the gather read it; the engine
thread never blocks). The second half (wait for the copy, per-layer
checksums, headers) runs on the store's writer thread before the records go to any tier.

A GPU-direct save (into a device slab) is split the same way by
``device_codec.begin_encode_on_device``: the engine thread queues the gather, the writer runs
the checksums and headers.

CPU layouts encode in one fused pass (gather + checksum while the bytes are in cache, compiled,
GIL released) on the calling thread: splitting it would read every byte twice, so the returned
second half has nothing left to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..blocks.codec import _check_block_ids, checked_output, encode_blocks, header_bytes, record_bytes, seal_records
from ..blocks.layout import EngineLayout
from ..blocks.tenant import DEFAULT_TENANT

#: the second half of an encode: returns the bytes of the records, ready to write
Seal = Callable[[], int]


def begin_encode(layout: EngineLayout, block_ids: Sequence[int], namespaces: Sequence[bytes],
                 keys: Sequence[bytes], parents: Sequence[bytes], out: Any, *,
                 tenant: bytes = DEFAULT_TENANT) -> Seal:
    """Start encoding ``block_ids`` of ``tenant`` into ``out`` (a host slab); call the result, on any thread, before
    reading ``out``. Raises at once for bad arguments, like ``encode_blocks``."""
    if not layout.is_cuda:
        n = encode_blocks(layout, block_ids, namespaces, keys, parents, out, tenant=tenant)
        return lambda: n
    import torch

    from ..staging.device_copy import queue_save

    shape = layout.shape
    dst = checked_output(shape, block_ids, namespaces, keys, parents, out)
    _check_block_ids(layout, block_ids)
    copied = queue_save(layout.layer_views, layout.device, block_ids, torch.from_numpy(dst),
                        record_bytes=record_bytes(shape), header_bytes=header_bytes(shape.num_layers),
                        layer_bytes=shape.layer_bytes)
    ns, ks, ps = list(namespaces), list(keys), list(parents)

    def seal() -> int:
        copied.synchronize()  # a blocking event: sleeps (GIL released) while the copy engine finishes
        return seal_records(dst, shape, layout.kind, ns, ks, ps, tenant=tenant)

    return seal
