"""Offload encoding split in two: what the engine thread must do, and what a background thread may.

``wait_for_save`` runs on the engine thread between forward passes, and after it returns vLLM may
hand the saved blocks to another request. On a CUDA engine the engine thread therefore only queues
the gather into the pinned host slab on a side stream, ordered after the forward that wrote the
blocks (the side stream waits for the engine's stream), and makes the engine's stream wait for the
copy (a GPU-side dependency: the next kernel that could overwrite a reused block starts after the
copy engine is done; the engine thread never blocks). The second half (wait for the copy, per-layer
checksums, headers) runs on the store's writer thread before the records go to any tier.

CPU layouts encode in one fused pass (gather + checksum while the bytes are in cache, compiled,
GIL released) on the calling thread: splitting it would read every byte twice, so the returned
second half has nothing left to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .codec import checked_output, encode_blocks, header_bytes, record_bytes, seal_records
from .layout import EngineLayout

#: the second half of an encode: returns the bytes of the records, ready to write
Seal = Callable[[], int]

_streams: dict[Any, Any] = {}  # one copy stream per CUDA device, shared by every layout on it


def _copy_stream(device: Any) -> Any:
    import torch

    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device)
    return s


def begin_encode(layout: EngineLayout, block_ids: Sequence[int], namespaces: Sequence[bytes],
                 keys: Sequence[bytes], parents: Sequence[bytes], out: Any) -> Seal:
    """Start encoding ``block_ids`` into ``out`` (a host slab); call the result, on any thread, before
    reading ``out``. Raises at once for bad arguments, like ``encode_blocks``."""
    if not layout.is_cuda:
        n = encode_blocks(layout, block_ids, namespaces, keys, parents, out)
        return lambda: n
    import torch

    from kernels import gather_records

    shape = layout.shape
    rb, hb = record_bytes(shape), header_bytes(shape.num_layers)
    dst = checked_output(shape, block_ids, namespaces, keys, parents, out)
    engine = torch.cuda.current_stream(layout.device)
    side = _copy_stream(layout.device)
    side.wait_stream(engine)  # after the forward that wrote these blocks
    with torch.cuda.stream(side):
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        gather_records(layout.layer_views, ids, torch.from_numpy(dst), record_bytes=rb, header_bytes=hb,
                       layer_bytes=shape.layer_bytes)
        copied = torch.cuda.Event()
        copied.record(side)
    engine.wait_event(copied)  # a reused block is overwritten only after the copy read it
    ns, ks, ps = list(namespaces), list(keys), list(parents)

    def seal() -> int:
        copied.synchronize()  # releases the GIL while the copy engine finishes
        return seal_records(dst, shape, layout.kind, ns, ks, ps)

    return seal
