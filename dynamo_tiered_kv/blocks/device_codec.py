"""Records built and verified in device memory, for GPU-direct transfers to and from the SSD.

Same byte format as ``codec`` (docs/FORMAT.md), produced where the KV lives so GPUDirect Storage
can write a record straight from GPU memory and read it straight back: payloads are gathered by
``kernels.gather_records``, each layer's XXH3-64 is computed on the device
(``kernels.xxh3_64_rows``), and only the small headers cross to the host, where they are built
and parsed by the same code as the host path.

Encoding comes in two halves (``begin_encode_on_device``, ordered by ``staging.device_save``): the
engine thread only queues the gather, after the forward that wrote the blocks, and returns; a
writer thread queues the checksums, copies them to pinned host memory, builds the headers and
copies them back, and returns once the slab holds whole records.

Verification before use is the same contract as ``codec.decode_blocks``: a record whose header,
identity or any layer checksum is wrong is reported and never scattered into the engine; the
others are.

Every function works on any torch device. CPU tensors are how CI exercises it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ChecksumMismatch, RecordError, RecordSealed
from ..staging import device_save
from ..staging.device_copy import RestoreSession, ids_on
from ..staging.device_order import Ops
from ..staging.device_slabs import synchronize
from .codec import (
    _check_block_ids,
    _check_identity,
    _write_header,
    decode_header,
    header_bytes,
    record_bytes,
)
from .keys import KEY_BYTES
from .layout import EngineLayout
from .tenant import DEFAULT_TENANT

log = logging.getLogger(__name__)


def _engine_views(layout: EngineLayout) -> list[torch.Tensor]:
    return [v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for v in layout.layer_views]


def _records(buf: torch.Tensor, n: int, rb: int) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("device record buffer must be a contiguous 1-D uint8 tensor")
    if buf.numel() < n * rb:
        raise ValueError(f"buffer holds {buf.numel()} bytes, {n} records need {n * rb}")
    return buf[: n * rb].view(n, rb)


def _layer_sums_on_device(recs: torch.Tensor, hb: int, nl: int, lb: int) -> torch.Tensor:
    """Per-record, per-layer XXH3-64 of the payloads, on the records' device: int64 [n * nl] (u64 bits),
    record by record. Only queues device work on the calling thread's stream: never waits for it."""
    from ..kernels import xxh3_64_rows

    # records x layers x bytes: a strided view of the payloads, hashed where they lie (records are
    # longer than their payloads, so flattening records x layers into one dimension would copy them)
    layers = recs[:, hb : hb + nl * lb].unflatten(1, (nl, lb))
    return xxh3_64_rows(layers).reshape(-1)


def _layer_sums(recs: torch.Tensor, hb: int, nl: int, lb: int) -> np.ndarray:
    """Per-record, per-layer XXH3-64 of the payloads, computed on the records' device -> host [n, nl] u64."""
    return _layer_sums_on_device(recs, hb, nl, lb).cpu().numpy().view(np.uint64).reshape(recs.shape[0], nl)


def encode_blocks_on_device(
    layout: EngineLayout,
    block_ids: Sequence[int],
    namespaces: Sequence[bytes],
    keys: Sequence[bytes],
    parents: Sequence[bytes],
    out: torch.Tensor,
    *,
    tenant: bytes = DEFAULT_TENANT,
) -> int:
    """Encode engine blocks of ``tenant`` back to back into ``out`` (device memory). Returns the bytes written.

    Both halves of ``begin_encode_on_device`` on the calling thread: returns once the records are
    complete in ``out`` (blocking on the gather and the checksums, so not for an engine thread).
    """
    return begin_encode_on_device(layout, block_ids, namespaces, keys, parents, out, tenant=tenant)()


def begin_encode_on_device(
    layout: EngineLayout,
    block_ids: Sequence[int],
    namespaces: Sequence[bytes],
    keys: Sequence[bytes],
    parents: Sequence[bytes],
    out: torch.Tensor,
    *,
    tenant: bytes = DEFAULT_TENANT,
    ops: Ops | None = None,
    save: Any = None,
    writer: Any = None,
) -> Callable[[], int]:
    """Start encoding engine blocks of ``tenant`` into ``out`` (device memory); returns the second half.

    The calling (engine) thread only queues the gather of the payloads into ``out``, after the
    engine's queued forward and before its later kernels (``device_save.queue_gather``): it never
    waits for the device. The returned callable, run on a writer thread, queues the checksums,
    builds the headers and returns the bytes written once ``out`` holds whole records
    (``device_save.finish``); ``out`` must not be read, reused or freed before it returned or
    raised. Bad arguments raise at once, on the calling thread.

    ``ops``, ``save``, ``writer``: the stream/event interface and the save and writer streams
    (default: ``torch.cuda``'s for a CUDA ``out``, run-at-once stand-ins for a CPU one).
    """
    from ..kernels import gather_records

    shape = layout.shape
    n, nl, lb = len(block_ids), shape.num_layers, shape.layer_bytes
    rb, hb = record_bytes(shape), header_bytes(nl)
    if not (len(namespaces) == len(keys) == len(parents) == n):
        raise ValueError("block_ids, namespaces, keys and parents must have the same length")
    if n == 0:
        return lambda: 0
    _check_block_ids(layout, block_ids)
    recs = _records(out, n, rb)
    device = out.device
    ops = ops if ops is not None else device_save.ops_for(device)
    views = _engine_views(layout)
    ids: list[torch.Tensor] = []

    def upload_ids() -> None:
        ids.append(device_save.ids_on(block_ids, device))

    def gather() -> None:
        gather_records(views, ids[0], out, record_bytes=rb, header_bytes=hb, layer_bytes=lb)

    with device_save.device_guard(device):
        gathered = device_save.queue_gather(ops, device, save if save is not None else device_save.save_stream(device),
                                            upload_ids=upload_ids, gather=gather)
    ns, ks, ps = list(namespaces), list(keys), list(parents)

    def seal() -> int:
        host: dict[str, torch.Tensor] = {}

        def checksum() -> None:  # device work, reading only the slab
            recs[:, hb + shape.payload_bytes :].zero_()  # deterministic padding
            sums = _layer_sums_on_device(recs, hb, nl, lb)
            host["sums"] = device_save.host_buffer((n * nl,), torch.int64, device)
            host["sums"].copy_(sums, non_blocking=True)

        def headers() -> None:  # host, once the sums are there
            sums = host["sums"].numpy().view(np.uint64).reshape(n, nl)
            heads = device_save.host_buffer((n, hb), torch.uint8, device)
            rows = heads.numpy()
            rows.fill(0)
            for i in range(n):
                _write_header(rows[i], shape, layout.kind, ns[i], ks[i], ps[i], sums[i], tenant)
            host["heads"] = heads

        def upload() -> None:  # one contiguous copy from pinned memory, then a device copy into the header rows
            recs[:, :hb].copy_(host["heads"].to(device, non_blocking=True))

        with device_save.device_guard(device):
            device_save.finish(ops, writer if writer is not None else device_save.writer_stream(device), gathered,
                               checksum=checksum, headers=headers, upload=upload)
        return n * rb

    return seal


def warm_up_device_kernels(layout: EngineLayout) -> None:
    """Compile and build now, not on the first save or restore, what a CUDA engine's saves and
    restores launch: the gather/scatter kernel for this layout's record geometry
    (``kernels.gather_scatter.warm_up``: block 0 is copied out and back, unchanged) and the
    checksum code (its tables are cached per stream: the writer and restore streams build theirs on
    first use, without blocking). Call at KV cache registration, before the engine
    runs, on the registering thread; waits for the device. Never raises: a failure is logged and
    left to the first save or restore (which then compiles, as without this call)."""
    if not layout.is_cuda:
        return
    from ..kernels import xxh3_64_rows
    from ..kernels.gather_scatter import warm_up

    shape = layout.shape
    try:
        views = _engine_views(layout)
        warm_up(views, record_bytes=record_bytes(shape), header_bytes=header_bytes(shape.num_layers),
                layer_bytes=shape.layer_bytes)
        device = views[0].device
        with device_save.device_guard(device):
            xxh3_64_rows(torch.zeros((1, shape.layer_bytes), dtype=torch.uint8, device=device))
            synchronize(device)
    except Exception as e:  # the first save or restore compiles instead
        log.warning("warming up the KV copy kernels failed (%s: %s); the first save or restore compiles them",
                    type(e).__name__, e)


def decode_blocks_on_device(
    records: torch.Tensor, layout: EngineLayout, block_ids: Sequence[int], *, namespace: bytes, keys: Sequence[bytes],
    session: RestoreSession | None = None,
) -> list[RecordError | None]:
    """Verify records laid back to back in ``records`` (device memory) and scatter the good ones.

    Returns one entry per record: None if it was verified and copied into ``block_ids[i]``, else
    the ``RecordError`` that rejected it (nothing of a rejected record reaches the engine).

    Runs on the calling thread's restore stream, under the records' device (a tensor-parallel
    rank's restore never launches on device 0), in ``session`` (``device_copy.RestoreSession``):
    the per-layer checksums and the headers reach the host with one wait, the host checks them,
    and the good records are scattered after the engine's mark, never after forwards queued since.
    The scatter is still in flight on return: ``records`` stays unwritten until the session says
    it is done (``RestoreSession.after``). None: a one-chunk session, done on return.
    """
    from ..kernels import scatter_records

    shape = layout.shape
    n, nl, lb = len(block_ids), shape.num_layers, shape.layer_bytes
    rb, hb = record_bytes(shape), header_bytes(nl)
    if len(keys) != n:
        raise ValueError("block_ids and keys must have the same length")
    if len(namespace) != KEY_BYTES or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError("namespace digest and keys must each be 16 bytes")
    if n == 0:
        return []
    _check_block_ids(layout, block_ids)
    recs = _records(records, n, rb)
    if session is None:
        with RestoreSession(records.device) as one:
            return decode_blocks_on_device(records, layout, block_ids, namespace=namespace, keys=keys, session=one)
    device = records.device
    pin = device.type == "cuda"
    host: dict[str, torch.Tensor] = {}

    def checks() -> None:  # reads only the records (no engine block): does not wait for the mark
        sums = _layer_sums_on_device(recs, hb, nl, lb)
        host["sums"] = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=pin)
        host["sums"].copy_(sums, non_blocking=True)
        host["heads"] = torch.empty((n, hb), dtype=torch.uint8, pin_memory=pin)
        host["heads"].copy_(recs[:, :hb], non_blocking=True)

    session.fetch(checks)  # the chunk's one host wait
    heads = host["heads"].numpy()
    sums = host["sums"].numpy().view(np.uint64).reshape(n, nl)
    errors: list[RecordError | None] = [None] * n
    for i in range(n):
        try:
            hdr = decode_header(heads[i])
            _check_identity(hdr, namespace, keys[i], shape)
            if hdr.sealed:
                raise RecordSealed(f"record {keys[i].hex()} is sealed for its tenant; this reader has not opened it")
        except RecordError as e:
            errors[i] = e
            continue
        bad = np.flatnonzero(np.asarray(hdr.layer_sums, dtype=np.uint64) != sums[i])
        if bad.size:
            errors[i] = ChecksumMismatch(f"layer {int(bad[0])} payload checksum mismatch (key {keys[i].hex()})")
    good = [i for i in range(n) if errors[i] is None]
    if good:
        views = _engine_views(layout)
        st: dict[str, torch.Tensor] = {}

        def pick() -> None:  # the good records and their blocks, on the restore stream
            st["ids"] = ids_on([block_ids[i] for i in good], device)
            st["src"] = recs if len(good) == n else recs.index_select(0, ids_on(good, device))

        def scatter() -> None:
            scatter_records(st["src"].reshape(-1), views, st["ids"], record_bytes=rb, header_bytes=hb,
                            layer_bytes=lb)

        session.queue(upload=pick, scatter=scatter)
    return errors
