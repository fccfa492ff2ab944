"""Self-describing, verified block records (byte format: docs/FORMAT.md).

A record is a header region (fixed fields + one checksum per layer, padded to 4 KiB) followed by
the canonical payload (padded to 4 KiB), so records can be written and read with O_DIRECT or
cuFile straight from and into staging slabs, and a layer range is one aligned byte range.

Encoding gathers one layer at a time from the engine into the slab and hashes it while it is
still in cache; decoding verifies the header, then each layer's checksum right before copying
that layer into the engine. Nothing unverified is ever copied out.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import xxhash

from .._native import fast
from ..errors import (
    BadMagic,
    ChecksumMismatch,
    HeaderCorrupt,
    KeyMismatch,
    LayoutMismatch,
    NamespaceMismatch,
    RecordError,
    RecordSealed,
    RecordTruncated,
    UnsupportedVersion,
)
from .keys import KEY_BYTES
from .layout import BlockShape, CanonicalFormat, DType, EngineLayout, EngineLayoutKind
from .tenant import DEFAULT_TENANT, TENANT_BYTES

if TYPE_CHECKING:
    from ..staging.device_copy import RestoreSession

MAGIC = b"DTKVBLK\x00"
FORMAT_VERSION = 1
ALIGN = 4096
CHECKSUM_XXH3_64 = 1
#: ``flags`` bit: the payload is encrypted for the record's tenant (``blocks.sealed``)
FLAG_SEALED = 0x0001

# magic, version, flags, header_bytes, namespace, key, parent, canonical, dtype, engine_kind,
# checksum_algo, num_layers, block_size, kv_heads, head_size, num_tokens, layer_bytes,
# payload_bytes, record_bytes, tenant (``blocks.tenant``; zero: the default tenant)
_FIXED = struct.Struct("<8sHHI16s16s16sBBBBIIIIIQQQ8s")
_FIXED_BYTES = _FIXED.size  # 120
_HDR_SUM_OFF = _FIXED_BYTES  # u64 header checksum
_TABLE_OFF = _HDR_SUM_OFF + 8  # 128: one u64 per layer
assert _FIXED_BYTES == 120


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def header_bytes(num_layers: int) -> int:
    return align_up(_TABLE_OFF + 8 * num_layers)


@functools.lru_cache(maxsize=64)
def record_bytes(shape: BlockShape) -> int:
    """Bytes one record of this shape occupies on every medium (a multiple of 4 KiB)."""
    return header_bytes(shape.num_layers) + align_up(shape.payload_bytes)


class RecordHeader(NamedTuple):  # a NamedTuple: built on every read, so construction must be cheap
    namespace: bytes
    key: bytes
    parent: bytes
    shape: BlockShape
    engine_kind: EngineLayoutKind
    num_tokens: int
    header_bytes: int
    record_bytes: int
    layer_sums: tuple[int, ...]
    tenant: bytes = DEFAULT_TENANT
    sealed: bool = False  # the payload is encrypted (``blocks.sealed``): open it before verifying layers

    @property
    def payload_offset(self) -> int:
        return self.header_bytes

    def layer_range(self, first: int, last: int) -> tuple[int, int]:
        """(offset, length) inside the record of layers [first, last)."""
        lb = self.shape.layer_bytes
        return self.header_bytes + first * lb, (last - first) * lb


def _as_u8(buf) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if a.dtype != np.uint8 or a.ndim != 1:
        a = a.reshape(-1).view(np.uint8)
    return a


@functools.lru_cache(maxsize=64)
def _descriptor(shape: BlockShape, engine_kind: EngineLayoutKind) -> tuple[bytes, bytes]:
    """The constant parts of the fixed header for a shape: bytes [0, 16) and [64, 112) (the tenant,
    bytes [112, 120), is per record)."""
    hb = header_bytes(shape.num_layers)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        hb,
        bytes(16),
        bytes(16),
        bytes(16),
        int(shape.canonical),
        int(shape.dtype),
        int(engine_kind),
        CHECKSUM_XXH3_64,
        shape.num_layers,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_size,
        shape.block_size,
        shape.layer_bytes,
        shape.payload_bytes,
        record_bytes(shape),
        bytes(8),
    )
    return fixed[:16], fixed[64:112]


def _write_header(
    out: np.ndarray, shape: BlockShape, engine_kind: EngineLayoutKind, namespace: bytes, key: bytes, parent: bytes,
    sums, tenant: bytes = DEFAULT_TENANT,
) -> None:
    if len(namespace) != KEY_BYTES or len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
        raise ValueError("namespace digest, key and parent must each be 16 bytes")
    if len(tenant) != TENANT_BYTES:
        raise ValueError(f"a tenant id is {TENANT_BYTES} bytes")
    prefix, desc = _descriptor(shape, engine_kind)
    fixed = prefix + namespace + key + parent + desc + tenant
    table = np.asarray(sums, dtype="<u8").tobytes()
    head = fixed + _U64.pack(xxhash.xxh3_64_intdigest(fixed + table)) + table
    out[: len(head)] = np.frombuffer(head, np.uint8)
    out[len(head) : header_bytes(shape.num_layers)] = 0


_U64 = struct.Struct("<Q")


def encode_block(layout: EngineLayout, block_id: int, namespace: bytes, key: bytes, parent: bytes, out, *,
                 tenant: bytes = DEFAULT_TENANT) -> int:
    """Gather engine block ``block_id`` into ``out`` as one record. Returns the record length.

    ``out`` is a writable uint8 buffer (a staging slab slice) of at least ``record_bytes``.
    """
    return encode_blocks(layout, [block_id], [namespace] * 1, [key], [parent], out, tenant=tenant)


def encode_blocks(
    layout: EngineLayout,
    block_ids: Sequence[int],
    namespaces: Sequence[bytes],
    keys: Sequence[bytes],
    parents: Sequence[bytes],
    out,
    *,
    tenant: bytes = DEFAULT_TENANT,
) -> int:
    """Encode several blocks of one tenant back to back into ``out``. Returns the total length written."""
    shape = layout.shape
    rb, hb, lb, nl = record_bytes(shape), header_bytes(shape.num_layers), shape.layer_bytes, shape.num_layers
    dst = checked_output(shape, block_ids, namespaces, keys, parents, out)
    n = len(block_ids)
    _check_block_ids(layout, block_ids)
    if layout.is_cuda:
        import torch

        from ..staging.device_copy import queue_save

        queue_save(layout.layer_views, layout.device, block_ids, torch.from_numpy(dst), record_bytes=rb,
                   header_bytes=hb, layer_bytes=lb).synchronize()
        return seal_records(dst, shape, layout.kind, namespaces, keys, parents, tenant=tenant)
    table = layout.fast_table()
    if table is not None:  # compiled path: one call for the whole batch, GIL released
        sums_all = np.empty((n, nl), dtype=np.uint64)
        fast.gather_hash(table, np.asarray(block_ids, dtype=np.int64), dst, rb, hb, sums_all)
        for i in range(n):
            _finish(dst[i * rb : (i + 1) * rb], shape, layout.kind, namespaces[i], keys[i], parents[i], sums_all[i],
                    tenant)
        return n * rb
    views = layout.layer_views
    h64 = xxhash.xxh3_64_intdigest
    copyto = np.copyto
    mv = memoryview(dst)
    for i, b in enumerate(block_ids):
        base = i * rb + hb
        layers = dst[base : base + nl * lb].reshape(nl, *views[0].shape[1:])
        sums = []
        for j in range(nl):
            copyto(layers[j], views[j][b])
            sums.append(h64(mv[base + j * lb : base + (j + 1) * lb]))  # hashed while still in cache
        _finish(dst[i * rb : (i + 1) * rb], shape, layout.kind, namespaces[i], keys[i], parents[i], sums, tenant)
    return n * rb


def checked_output(shape: BlockShape, block_ids: Sequence[int], namespaces: Sequence[bytes], keys: Sequence[bytes],
                   parents: Sequence[bytes], out) -> np.ndarray:
    """``out`` as a flat uint8 array, once the batch's arguments agree and it holds every record."""
    dst = _as_u8(out)
    n = len(block_ids)
    if not (len(namespaces) == len(keys) == len(parents) == n):
        raise ValueError("block_ids, namespaces, keys and parents must have the same length")
    if dst.nbytes < n * record_bytes(shape):
        raise ValueError(f"output buffer holds {dst.nbytes} bytes, {n} records need {n * record_bytes(shape)}")
    return dst


def seal_records(dst: np.ndarray, shape: BlockShape, kind: EngineLayoutKind, namespaces: Sequence[bytes],
                 keys: Sequence[bytes], parents: Sequence[bytes], *, tenant: bytes = DEFAULT_TENANT) -> int:
    """Checksums and headers of ``len(keys)`` records of ``tenant`` whose payloads are already in ``dst`` (gathered
    by a device copy). Returns the bytes of the records."""
    rb, hb, lb, nl = record_bytes(shape), header_bytes(shape.num_layers), shape.layer_bytes, shape.num_layers
    mv = memoryview(dst)
    for i in range(len(keys)):
        base = i * rb + hb
        sums = [xxhash.xxh3_64_intdigest(mv[base + j * lb : base + (j + 1) * lb]) for j in range(nl)]
        _finish(dst[i * rb : (i + 1) * rb], shape, kind, namespaces[i], keys[i], parents[i], sums, tenant)
    return len(keys) * rb


def _finish(
    rec: np.ndarray,
    shape: BlockShape,
    kind: EngineLayoutKind,
    ns: bytes,
    key: bytes,
    parent: bytes,
    sums: Sequence[int],
    tenant: bytes = DEFAULT_TENANT,
) -> None:
    hb = header_bytes(shape.num_layers)
    end = hb + shape.payload_bytes
    rec[end : record_bytes(shape)] = 0  # deterministic padding
    _write_header(rec, shape, kind, ns, key, parent, sums, tenant)


def encode_payload(
    payload,
    shape: BlockShape,
    namespace: bytes,
    key: bytes,
    parent: bytes,
    out,
    engine_kind: EngineLayoutKind = EngineLayoutKind.FLASH_ATTN,
    *,
    tenant: bytes = DEFAULT_TENANT,
) -> int:
    """Encode an already-canonical payload (tools, tests, re-encoding). Returns the record length."""
    src = _as_u8(payload)
    if src.nbytes != shape.payload_bytes:
        raise ValueError(f"payload is {src.nbytes} bytes, shape needs {shape.payload_bytes}")
    rec = _as_u8(out)[: record_bytes(shape)]
    hb, lb = header_bytes(shape.num_layers), shape.layer_bytes
    rec[hb : hb + src.nbytes] = src
    sums = [xxhash.xxh3_64_intdigest(rec[hb + j * lb : hb + (j + 1) * lb]) for j in range(shape.num_layers)]
    _finish(rec, shape, engine_kind, namespace, key, parent, sums, tenant)
    return rec.nbytes


_PREFIX = struct.Struct("<8sHHI")
_DESC = struct.Struct("<BBBBIIIIIQQQ")


def decode_header(buf) -> RecordHeader:
    """Parse and verify a record header (magic, version, header checksum, lengths)."""
    a = _as_u8(buf)
    if a.nbytes < _TABLE_OFF:
        raise RecordTruncated(f"{a.nbytes} bytes is shorter than a record header")
    magic, version, flags, hb = _PREFIX.unpack_from(a, 0)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"record format version {version}, this reader understands {FORMAT_VERSION}")
    nl = int.from_bytes(a[68:72], "little")
    if nl <= 0 or nl > 65536 or hb != header_bytes(nl):
        raise HeaderCorrupt(f"implausible header (layers={nl}, header_bytes={hb})")
    if a.nbytes < hb:
        raise RecordTruncated(f"{a.nbytes} bytes, header needs {hb}")
    mv = memoryview(a)
    h = xxhash.xxh3_64(mv[:_FIXED_BYTES])
    h.update(mv[_TABLE_OFF : _TABLE_OFF + 8 * nl])
    if h.intdigest() != _U64.unpack_from(a, _HDR_SUM_OFF)[0]:
        raise HeaderCorrupt("record header checksum mismatch")
    shape, kind = _parse_descriptor(bytes(mv[64:112]))
    table = a[_TABLE_OFF : _TABLE_OFF + 8 * nl].view("<u8")
    ns, key, parent = bytes(mv[16:32]), bytes(mv[32:48]), bytes(mv[48:64])
    return RecordHeader(ns, key, parent, shape, kind, shape.block_size, hb, record_bytes(shape), tuple(table.tolist()),
                        bytes(mv[112:_FIXED_BYTES]), bool(flags & FLAG_SEALED))


@functools.lru_cache(maxsize=256)
def _parse_descriptor(desc: bytes) -> tuple[BlockShape, EngineLayoutKind]:
    """Layout descriptor (bytes [64, 112)) -> shape; cached since a store sees few distinct shapes."""
    canon, dtype, ekind, algo, nl, bs, heads, hs, ntok, lb, pb, rb = _DESC.unpack(desc)
    if algo != CHECKSUM_XXH3_64:
        raise HeaderCorrupt(f"unknown checksum algorithm {algo}")
    try:
        shape = BlockShape(CanonicalFormat(canon), DType(dtype), nl, bs, heads, hs)
        kind = EngineLayoutKind(ekind)
    except ValueError as e:
        raise HeaderCorrupt(f"invalid layout descriptor: {e}") from None
    if lb != shape.layer_bytes or pb != shape.payload_bytes or rb != record_bytes(shape) or ntok != bs:
        raise HeaderCorrupt("record lengths disagree with its layout descriptor")
    return shape, kind


def verify_record(
    buf,
    *,
    namespace: bytes | None = None,
    key: bytes | None = None,
    shape: BlockShape | None = None,
    layers: tuple[int, int] | None = None,
) -> RecordHeader:
    """Verify a whole record (or only layers [first, last) of it) and its identity.

    Raises a ``RecordError`` subclass on any mismatch; returns the parsed header otherwise. A sealed
    record's payload is checked only where it is opened (its GCM tag, ``blocks.sealed``): here its
    header and identity are.
    """
    a = _as_u8(buf)
    hdr = decode_header(a)
    _check_identity(hdr, namespace, key, shape)
    if hdr.sealed:
        return hdr
    first, last = layers or (0, hdr.shape.num_layers)
    end = hdr.header_bytes + last * hdr.shape.layer_bytes
    if a.nbytes < end:
        raise RecordTruncated(f"{a.nbytes} bytes, layers up to {last} need {end}")
    lb = hdr.shape.layer_bytes
    mv = memoryview(a)
    for j in range(first, last):
        off = hdr.header_bytes + j * lb
        if xxhash.xxh3_64_intdigest(mv[off : off + lb]) != hdr.layer_sums[j]:
            raise ChecksumMismatch(f"layer {j} payload checksum mismatch (key {hdr.key.hex()})")
    return hdr


def _verify_to_serve(buf, namespace: bytes, key: bytes, shape: BlockShape) -> RecordHeader:
    """``verify_record`` for bytes about to reach the engine: a sealed record is refused too."""
    hdr = verify_record(buf, namespace=namespace, key=key, shape=shape)
    if hdr.sealed:
        raise RecordSealed(f"record {key.hex()} is sealed for its tenant; this reader has not opened it")
    return hdr


def decode_block(buf, layout: EngineLayout, block_id: int, *, namespace: bytes, key: bytes) -> RecordHeader:
    """Verify a record and scatter it into engine block ``block_id``.

    The header (identity, shape, checksum table) is verified before anything is copied; then each
    layer is verified and copied while it is in cache. Only verified bytes ever reach the engine:
    on a ``ChecksumMismatch`` in layer ``j`` the block holds verified layers ``< j`` and its old
    contents from ``j`` on, and the caller must treat the whole block as not loaded (recompute).
    """
    a = _as_u8(buf)
    _check_block_ids(layout, [block_id])
    hdr = decode_header(a)
    _check_identity(hdr, namespace, key, layout.shape)
    if hdr.sealed:
        raise RecordSealed(f"record {key.hex()} is sealed for its tenant; this reader has not opened it")
    hb, lb, nl = hdr.header_bytes, hdr.shape.layer_bytes, hdr.shape.num_layers
    if a.nbytes < hb + nl * lb:
        raise RecordTruncated(f"{a.nbytes} bytes, record needs {hb + nl * lb}")
    sums = hdr.layer_sums
    h64 = xxhash.xxh3_64_intdigest
    mv = memoryview(a)
    if layout.is_cuda:
        _verify_to_serve(a, namespace, key, layout.shape)  # all of it before the async copy
        _restore_cuda(layout, [a], [block_id], None)
        return hdr
    table = layout.fast_table()
    if table is not None:
        bad = fast.verify_scatter(
            table, block_id, a[hb : hb + nl * lb], a[_TABLE_OFF : _TABLE_OFF + 8 * nl].view("<u8")
        )
        if bad >= 0:
            raise ChecksumMismatch(f"layer {bad} payload checksum mismatch (key {hdr.key.hex()})")
        return hdr
    views = layout.layer_views
    layers = a[hb : hb + nl * lb].reshape(nl, *views[0].shape[1:])
    copyto = np.copyto
    for j in range(nl):
        if h64(mv[hb + j * lb : hb + (j + 1) * lb]) != sums[j]:
            raise ChecksumMismatch(f"layer {j} payload checksum mismatch (key {hdr.key.hex()})")
        copyto(views[j][block_id], layers[j])
    return hdr


#: ``spread(n, verify)``: ``verify(a, b)`` over ``[0, n)`` cut into ranges, maybe on several threads;
#: the per-record results in order (``store.reads.fanout.fan_out``)
Spread = Callable[[int, Callable[[int, int], list[RecordError | None]]], list[RecordError | None]]


def decode_blocks(
    buf, layout: EngineLayout, block_ids: Sequence[int], *, namespace: bytes, keys: Sequence[bytes],
    session: RestoreSession | None = None, spread: Spread | None = None,
) -> list[RecordError | None]:
    """Batch ``decode_block`` over records laid back to back in ``buf`` (one staging slab).

    Returns one entry per record: None if it was verified and copied into ``block_ids[i]``, else
    the ``RecordError`` that rejected it (same partial-copy rule as ``decode_block``). Never
    raises for a bad record, so one corrupt block does not fail its neighbours.

    ``session`` (CUDA layouts): the load this batch belongs to; the copy to the device is then
    still in flight on return and ``buf`` stays unwritten until the session says it is done
    (``RestoreSession.after``). None: the blocks hold the records on return. ``spread`` (CUDA
    layouts): runs the host verify of the records, which the calling thread then copies.
    """
    a = _as_u8(buf)
    n = len(block_ids)
    if len(keys) != n:
        raise ValueError("block_ids and keys must have the same length")
    if len(namespace) != KEY_BYTES or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError("namespace digest and keys must each be 16 bytes")  # the C path compares 16 bytes
    rb = record_bytes(layout.shape)
    if a.nbytes < n * rb:
        raise ValueError(f"buffer holds {a.nbytes} bytes, {n} records need {n * rb}")
    _check_block_ids(layout, block_ids)
    if layout.is_cuda:
        return _decode_cuda([a[i * rb : (i + 1) * rb] for i in range(n)], layout, block_ids, namespace, keys, a,
                            session, spread)
    table = layout.fast_table()
    if table is None:
        out: list[RecordError | None] = []
        for i in range(n):
            try:
                decode_block(a[i * rb : (i + 1) * rb], layout, block_ids[i], namespace=namespace, key=keys[i])
                out.append(None)
            except RecordError as e:
                out.append(e)
        return out
    prefix, desc = _descriptor(layout.shape, layout.kind)
    status = np.full(n, fast.OK, np.int64)
    fast.decode_batch(
        table,
        a,
        rb,
        header_bytes(layout.shape.num_layers),
        prefix,
        desc,
        namespace,
        b"".join(keys),
        np.asarray(block_ids, dtype=np.int64),
        status,
    )
    return _errors(status, lambda i: a[i * rb : (i + 1) * rb], layout, namespace, keys)


def decode_records(
    records: Sequence[np.ndarray], layout: EngineLayout, block_ids: Sequence[int], *, namespace: bytes,
    keys: Sequence[bytes], session: RestoreSession | None = None
) -> list[RecordError | None]:
    """``decode_blocks`` over records that are not back to back (each a contiguous uint8 array of at
    least ``record_bytes``): verified and scattered where they lie, e.g. in the host tier's arena,
    with no copy into a staging slab first. Same result and partial-copy rules; ``session`` as
    there (CUDA layouts pack the records into the session's pinned scratch, so ``records`` are
    free again on return)."""
    n = len(block_ids)
    if len(keys) != n or len(records) != n:
        raise ValueError("records, block_ids and keys must have the same length")
    if len(namespace) != KEY_BYTES or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError("namespace digest and keys must each be 16 bytes")
    rb = record_bytes(layout.shape)
    recs = [_as_u8(r) for r in records]
    if any(r.nbytes < rb or not r.flags.c_contiguous for r in recs):
        raise ValueError(f"every record must be a contiguous buffer of at least {rb} bytes")
    _check_block_ids(layout, block_ids)
    if layout.is_cuda:
        return _decode_cuda(recs, layout, block_ids, namespace, keys, None, session)
    table = layout.fast_table()
    if table is None:
        return [decode_blocks(r, layout, [b], namespace=namespace, keys=[k])[0]
                for r, b, k in zip(recs, block_ids, keys)]
    prefix, desc = _descriptor(layout.shape, layout.kind)
    status = np.full(n, fast.OK, np.int64)
    ptrs = np.array([r.ctypes.data for r in recs], dtype=np.uint64)
    fast.decode_ptrs(table, ptrs, header_bytes(layout.shape.num_layers), prefix, desc, namespace, b"".join(keys),
                     np.asarray(block_ids, dtype=np.int64), status)
    return _errors(status, recs.__getitem__, layout, namespace, keys)


def _decode_cuda(recs: Sequence[np.ndarray], layout: EngineLayout, block_ids: Sequence[int], namespace: bytes,
                 keys: Sequence[bytes], chunk: np.ndarray | None,
                 session: RestoreSession | None = None, spread: Spread | None = None) -> list[RecordError | None]:
    """CUDA batch restore: every record verified on the host first (``verify_for_device``, over
    ``spread``'s threads when given), then the good ones reach the engine with one host-to-device copy
    and one scatter (``device_copy.restore_records``) queued on this thread, in ``session`` (the host
    verifies the next batch while this one's copy runs)."""
    def verify(a: int, b: int) -> list[RecordError | None]:
        return verify_for_device(recs[a:b], layout, namespace=namespace, keys=keys[a:b])

    errors = verify(0, len(recs)) if spread is None else spread(len(recs), verify)
    good = [i for i in range(len(recs)) if errors[i] is None]
    if good:
        whole = chunk if len(good) == len(recs) else None  # back to back and all good: upload as is
        _restore_cuda(layout, [recs[i] for i in good], [block_ids[i] for i in good], whole, session)
    return errors


def verify_is_compiled(layout: EngineLayout) -> bool:
    """Whether ``verify_for_device`` checks this layout's records in the compiled helper, which runs
    without the GIL: then a chunk's verify split over threads runs in parallel."""
    return fast.AVAILABLE and layout.shape.num_layers <= fast.MAX_LAYERS


def verify_for_device(recs: Sequence[np.ndarray], layout: EngineLayout, *, namespace: bytes,
                      keys: Sequence[bytes]) -> list[RecordError | None]:
    """``_verify_to_serve`` of each record (contiguous, at least ``record_bytes``) about to be copied
    to a device: one entry per record, None if it may be copied, else the error that refuses it.

    One call of the compiled helper for all of them where it is built (GIL released; a record it
    rejects is checked again in Python to name the error); else record by record in Python, where
    python-xxhash keeps the GIL for inputs up to 64 KiB (a layer of one block per rank is usually
    smaller), so threads would only take turns. Any thread; reads ``recs`` only."""
    shape = layout.shape
    if verify_is_compiled(layout) and all(r.flags.c_contiguous for r in recs):
        prefix, desc = _descriptor(shape, layout.kind)
        status = fast.verify_batch(recs, shape.num_layers, shape.layer_bytes, header_bytes(shape.num_layers),
                                   prefix, desc, namespace, b"".join(keys))
        return _errors(status, recs.__getitem__, layout, namespace, keys)
    errors: list[RecordError | None] = [None] * len(recs)
    for i, r in enumerate(recs):
        try:
            _verify_to_serve(r, namespace, keys[i], shape)
        except RecordError as e:
            errors[i] = e
    return errors


def _restore_cuda(layout: EngineLayout, recs: Sequence[np.ndarray], block_ids: Sequence[int],
                  chunk: np.ndarray | None, session: RestoreSession | None = None) -> None:
    from ..staging.device_copy import restore_records

    shape = layout.shape
    restore_records(recs, layout.layer_views, layout.device, block_ids, record_bytes=record_bytes(shape),
                    header_bytes=header_bytes(shape.num_layers), layer_bytes=shape.layer_bytes, chunk=chunk,
                    session=session)


def _errors(status: np.ndarray, rec: Callable[[int], np.ndarray], layout: EngineLayout, namespace: bytes,
            keys: Sequence[bytes]) -> list[RecordError | None]:
    """The compiled decoder's status codes as errors (None = restored)."""
    errors: list[RecordError | None] = [None] * len(status)
    for i in np.flatnonzero(status != fast.OK):
        code = int(status[i])
        if code >= 0 and not _PREFIX.unpack_from(rec(i), 0)[2] & FLAG_SEALED:
            errors[i] = ChecksumMismatch(f"layer {code} payload checksum mismatch (key {keys[i].hex()})")
            continue
        try:  # the slow path names the exact problem
            _verify_to_serve(rec(i), namespace, keys[i], layout.shape)
            errors[i] = HeaderCorrupt(f"record {i} rejected by the compiled verifier (code {code})")
        except RecordError as e:
            errors[i] = e
    return errors


def _check_block_ids(layout: EngineLayout, block_ids: Sequence[int]) -> None:
    """Engine block ids index raw memory in the compiled and CUDA paths: refuse bad ones up front."""
    if len(block_ids) and (min(block_ids) < 0 or max(block_ids) >= layout.num_blocks):
        raise IndexError(f"block id out of range [0, {layout.num_blocks}): {list(block_ids)}")


def _check_identity(hdr: RecordHeader, namespace: bytes | None, key: bytes | None, shape: BlockShape | None) -> None:
    if namespace is not None and hdr.namespace != namespace:
        raise NamespaceMismatch("record belongs to another namespace (model, layout or tenant)")
    if key is not None and hdr.key != key:
        raise KeyMismatch(f"record key {hdr.key.hex()} != expected {key.hex()}")
    if shape is not None and hdr.shape != shape:
        raise LayoutMismatch(f"record shape {hdr.shape} does not fit engine shape {shape}")


def payload_view(buf, *, namespace: bytes | None = None, key: bytes | None = None) -> np.ndarray:
    """The verified canonical payload of a record, as a uint8 view (no copy)."""
    a = _as_u8(buf)
    hdr = verify_record(a, namespace=namespace, key=key)
    if hdr.sealed:
        raise RecordSealed("record is sealed for its tenant; open it (blocks.sealed) before reading its payload")
    return a[hdr.header_bytes : hdr.header_bytes + hdr.shape.payload_bytes]


def record_tenant(buf) -> bytes:
    """The tenant a record's header names (bytes [112, 120)), read without verifying anything:
    for accounting only (quotas, listings). Bytes that do not start like a record (tests store
    arbitrary values in tiers) belong to the default tenant."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(_as_u8(buf))
    if mv.nbytes < _FIXED_BYTES or bytes(mv[:8]) != MAGIC:
        return DEFAULT_TENANT
    return bytes(mv[112:_FIXED_BYTES])
