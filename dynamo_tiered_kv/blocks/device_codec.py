"""Records built and verified in device memory, for GPU-direct transfers to and from the SSD.

Same byte format as ``codec`` (docs/FORMAT.md), produced where the KV lives so GPUDirect Storage
can write a record straight from GPU memory and read it straight back: payloads are gathered by
``kernels.gather_records``, each layer's XXH3-64 is computed on the device
(``kernels.xxh3_64_rows``), and only the small headers cross to the host, where they are built
and parsed by the same code as the host path.

Verification before use is the same contract as ``codec.decode_blocks``: a record whose header,
identity or any layer checksum is wrong is reported and never scattered into the engine; the
others are.

Every function works on any torch device. CPU tensors are how CI exercises it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ChecksumMismatch, RecordError, RecordSealed
from ..staging.device_copy import RestoreSession, ids_on
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


def _engine_views(layout: EngineLayout) -> list[torch.Tensor]:
    return [v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for v in layout.layer_views]


def _records(buf: torch.Tensor, n: int, rb: int) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("device record buffer must be a contiguous 1-D uint8 tensor")
    if buf.numel() < n * rb:
        raise ValueError(f"buffer holds {buf.numel()} bytes, {n} records need {n * rb}")
    return buf[: n * rb].view(n, rb)


def _layer_sums_on_device(recs: torch.Tensor, hb: int, nl: int, lb: int) -> torch.Tensor:
    """Per-record, per-layer XXH3-64 of the payloads, on the records' device: int64 [n * nl] (u64 bits)."""
    from ..kernels import xxh3_64_rows

    # one row per layer: a copy of the payloads, not a view (records are longer than their payloads,
    # so records x layers does not flatten into one strided dimension)
    rows = recs[:, hb : hb + nl * lb].unflatten(1, (nl, lb)).flatten(0, 1)
    return xxh3_64_rows(rows)


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

    Returns once the records are complete in ``out`` (an event on this thread's stream), so the
    engine may reuse its blocks and a GDS write may start.
    """
    from ..kernels import gather_records

    shape = layout.shape
    n, nl, lb = len(block_ids), shape.num_layers, shape.layer_bytes
    rb, hb = record_bytes(shape), header_bytes(nl)
    if not (len(namespaces) == len(keys) == len(parents) == n):
        raise ValueError("block_ids, namespaces, keys and parents must have the same length")
    if n == 0:
        return 0
    _check_block_ids(layout, block_ids)
    recs = _records(out, n, rb)
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    gather_records(_engine_views(layout), ids, out, record_bytes=rb, header_bytes=hb, layer_bytes=lb)
    recs[:, hb + shape.payload_bytes :].zero_()  # deterministic padding
    sums = _layer_sums(recs, hb, nl, lb)  # waits for the gather: the sums are copied to the host
    heads = np.zeros((n, hb), np.uint8)
    for i in range(n):
        _write_header(heads[i], shape, layout.kind, namespaces[i], keys[i], parents[i], sums[i], tenant)
    recs[:, :hb].copy_(torch.from_numpy(heads))
    synchronize(out.device)
    return n * rb


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
