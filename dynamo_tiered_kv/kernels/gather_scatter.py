"""Payload movers used by the codec for CUDA layouts (and usable on CPU tensors for testing).

Record geometry (docs/FORMAT.md): record ``i`` starts at ``i * record_bytes``; layer ``j`` of its
payload starts at ``header_bytes + j * layer_bytes`` and holds ``planes`` equal parts.
Engine geometry: per layer a byte view ``[num_blocks, planes, plane_bytes]`` (``EngineLayout.layer_views``).

The Triton kernel moves 16 bytes per access (128-bit loads and stores) when every address,
stride, offset and size it forms is a multiple of 16 (``vector_bytes``; real KV layouts are),
else one byte per access. It launches under the tensors' device (``torch.cuda.device``), so a
tensor-parallel rank's copy never lands on device 0. ``warm_up`` compiles it at KV cache
registration rather than on the first save or restore.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch

try:  # Triton only exists with CUDA builds; the torch path covers everything else
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False


#: Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernel on CPU tensors: how CI checks it
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    return _HAVE_TRITON and torch.cuda.is_available()


def _use_triton(dev: torch.device, buf: torch.device, layer_views: Sequence[torch.Tensor]) -> bool:
    if not (_HAVE_TRITON and _flat_planes(layer_views)):
        return False
    if dev.type == "cuda":
        return buf.type == "cuda" and torch.cuda.is_available()
    return _INTERPRET and dev.type == buf.type == "cpu"


def _record_views(
    out: torch.Tensor, n: int, record_bytes: int, header_bytes: int, layer_bytes: int, num_layers: int, planes: int
) -> torch.Tensor:
    """``out`` (flat uint8) as ``[n, layers, planes, plane_bytes]`` over the records' payloads."""
    recs = out[: n * record_bytes].view(n, record_bytes)
    payload = recs[:, header_bytes : header_bytes + num_layers * layer_bytes]
    return payload.unflatten(1, (num_layers, planes, layer_bytes // planes))


def _flat_planes(layer_views: Sequence[torch.Tensor]) -> bool:
    """The Triton kernel moves ``[block][plane][bytes]`` views with contiguous plane bytes only
    (SGLang's page_first/page_head host views split a plane by token and take the torch path)."""
    return all(v.dim() == 3 and v.stride(2) == 1 for v in layer_views)


def gather_records(
    layer_views: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    record_bytes: int,
    header_bytes: int,
    layer_bytes: int,
) -> None:
    """Copy blocks ``block_ids`` of every layer into the payload areas of ``len(block_ids)`` records.

    ``out`` may live on another device than the engine (a pinned host slab): copies are issued
    non-blocking on the current stream; the caller synchronizes before reading ``out``.
    """
    n, nl = int(block_ids.numel()), len(layer_views)
    planes = int(layer_views[0].shape[1])
    dev = layer_views[0].device
    if n == 0:
        return
    if _use_triton(dev, out.device, layer_views):
        _triton_move(layer_views, block_ids, out, record_bytes, header_bytes, layer_bytes, gather=True)
        return
    dst = _record_views(out, n, record_bytes, header_bytes, layer_bytes, nl, planes)
    ids = block_ids.to(dev)
    for j, v in enumerate(layer_views):  # views may split a plane further ([block][plane][token][...])
        dst[:, j].copy_(v.index_select(0, ids).reshape(dst[:, j].shape), non_blocking=True)


def scatter_records(
    records: torch.Tensor,
    layer_views: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    record_bytes: int,
    header_bytes: int,
    layer_bytes: int,
) -> None:
    """Inverse of ``gather_records``: records' payloads -> engine blocks ``block_ids``.

    Only call with records whose checksums have been verified (``codec.verify_record``).
    """
    n, nl = int(block_ids.numel()), len(layer_views)
    planes = int(layer_views[0].shape[1])
    dev = layer_views[0].device
    if n == 0:
        return
    if _use_triton(dev, records.device, layer_views):
        _triton_move(layer_views, block_ids, records, record_bytes, header_bytes, layer_bytes, gather=False)
        return
    src = _record_views(records, n, record_bytes, header_bytes, layer_bytes, nl, planes)
    ids = block_ids.to(dev)
    for j, v in enumerate(layer_views):
        v.index_copy_(0, ids, src[:, j].to(dev, non_blocking=True).reshape(n, *v.shape[1:]))


#: bytes per access of the vectorized kernel: one 128-bit load/store per thread per step
VECTOR_BYTES = 16

if _HAVE_TRITON:

    @triton.jit
    def _move_kernel(
        layer_ptrs,
        block_ids,
        rec_ptr,
        block_stride,
        plane_stride,
        plane_bytes,
        record_bytes,
        header_bytes,
        layer_bytes,
        planes,
        GATHER: tl.constexpr,
        CHUNK: tl.constexpr,
        VEC: tl.constexpr,
    ):
        # grid: (n blocks, layers * planes, chunks per plane)
        i = tl.program_id(0)
        lp = tl.program_id(1)
        c = tl.program_id(2)
        layer = lp // planes
        plane = lp % planes
        b = tl.load(block_ids + i).to(tl.int64)
        base = tl.load(layer_ptrs + layer).to(tl.pointer_type(tl.uint8))
        eng0 = base + b * block_stride + plane * plane_stride
        rec0 = rec_ptr + i.to(tl.int64) * record_bytes + header_bytes + layer * layer_bytes + plane * plane_bytes
        if VEC > 1:
            # the host checked that every base address, stride, offset and size is a multiple of
            # VEC bytes: said here, the compiler moves VEC bytes per access instead of one (the
            # layer addresses come from memory, so it cannot know their alignment by itself)
            eng0 = tl.multiple_of(eng0, VEC)
            rec0 = tl.multiple_of(rec0, VEC)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < plane_bytes
        eng = eng0 + offs
        rec = rec0 + offs
        if GATHER:
            tl.store(rec, tl.load(eng, mask=mask), mask=mask)
        else:
            tl.store(eng, tl.load(rec, mask=mask), mask=mask)


_tables: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _pointer_table(layer_views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The layers' base addresses on their device, built once per set of KV tensors (an engine
    registers its caches once, and ``warm_up`` builds its table then). The upload goes through
    pinned memory without blocking: a first save queued behind a forward does not wait for it."""
    dev = layer_views[0].device
    key = (dev, tuple(v.data_ptr() for v in layer_views))
    t = _tables.get(key)
    if t is None:
        if len(_tables) >= 64:  # tests and benches build many layouts; an engine keeps one
            _tables.clear()
        host = torch.tensor(key[1], dtype=torch.int64)
        t = _tables[key] = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
    return t


def vector_bytes(layer_views: Sequence[torch.Tensor], records: torch.Tensor, record_bytes: int, header_bytes: int,
                 layer_bytes: int) -> int:
    """Bytes per access the kernel may use for these views and records: ``VECTOR_BYTES`` when every
    address and offset it forms is a multiple of it, else 1 (byte accesses, any alignment)."""
    v0 = layer_views[0]
    sizes = [records.data_ptr(), record_bytes, header_bytes, layer_bytes, int(v0.shape[2]), v0.stride(0),
             v0.stride(1), *(v.data_ptr() for v in layer_views)]
    return VECTOR_BYTES if all(x % VECTOR_BYTES == 0 for x in sizes) else 1


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Launch on the tensors' device, not the thread's current one (device 0 unless set)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _triton_move(
    layer_views: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    records: torch.Tensor,
    record_bytes: int,
    header_bytes: int,
    layer_bytes: int,
    *,
    gather: bool,
) -> None:
    v0 = layer_views[0]
    planes, plane_bytes = int(v0.shape[1]), int(v0.shape[2])
    if any(v.stride() != v0.stride() for v in layer_views):
        raise ValueError("all layer views must share strides")
    with _device_guard(v0.device):
        ptrs = _pointer_table(layer_views)
        ids = block_ids.to(dtype=torch.int64)
        if ids.device != v0.device:
            ids = (ids.pin_memory() if v0.device.type == "cuda" else ids).to(v0.device, non_blocking=True)
        chunk = 4096
        grid = (int(ids.numel()), len(layer_views) * planes, triton.cdiv(plane_bytes, chunk))
        _move_kernel[grid](
            ptrs,
            ids,
            records,
            v0.stride(0),
            v0.stride(1),
            plane_bytes,
            record_bytes,
            header_bytes,
            layer_bytes,
            planes,
            GATHER=gather,
            CHUNK=chunk,
            VEC=vector_bytes(layer_views, records, record_bytes, header_bytes, layer_bytes),
        )


def warm_up(layer_views: Sequence[torch.Tensor], *, record_bytes: int, header_bytes: int, layer_bytes: int) -> bool:
    """Compile the kernel variants saves and restores of these views will launch, and build their
    pointer table, now instead of on the first save or restore (a Triton JIT compile takes
    seconds, on the engine's or a restore's thread). Gathers engine block 0 into a scratch record
    and scatters it back, so the block's bytes are unchanged; call before the engine runs (KV
    cache registration), on the thread that registers. Returns whether a kernel was launched
    (False: these views take the torch path, nothing to compile). Waits for the two launches."""
    if not layer_views or not _use_triton(layer_views[0].device, layer_views[0].device, layer_views):
        return False
    dev = layer_views[0].device
    with _device_guard(dev):
        scratch = torch.empty(record_bytes, dtype=torch.uint8, device=dev)
        ids = torch.zeros(1, dtype=torch.int64, device=dev)
        _triton_move(layer_views, ids, scratch, record_bytes, header_bytes, layer_bytes, gather=True)
        _triton_move(layer_views, ids, scratch, record_bytes, header_bytes, layer_bytes, gather=False)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
    return True
