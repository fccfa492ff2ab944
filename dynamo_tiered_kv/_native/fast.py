"""ctypes bindings for ``_fastcodec`` (built from fastcodec.c when a C compiler was available).

ctypes drops the GIL for the duration of each call, so a batch encode or decode runs without
holding up the engine's Python threads.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

try:
    from . import _fastcodec  # type: ignore[attr-defined]

    _lib = ctypes.CDLL(_fastcodec.__file__)
    _i64, _p = ctypes.c_int64, ctypes.c_void_p
    _lib.dtkv_xxh3_64.argtypes = [_p, ctypes.c_size_t]
    _lib.dtkv_xxh3_64.restype = ctypes.c_uint64
    _lib.dtkv_xxh3_best.argtypes = []
    _lib.dtkv_xxh3_best.restype = ctypes.c_int
    _lib.dtkv_xxh3_64_variant.argtypes = [ctypes.c_int, _p, ctypes.c_size_t]
    _lib.dtkv_xxh3_64_variant.restype = ctypes.c_uint64
    _lib.dtkv_gather_hash.argtypes = [_p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _i64, _i64, _p]
    _lib.dtkv_gather_hash.restype = ctypes.c_int
    _lib.dtkv_verify_scatter.argtypes = [_p, _i64, _i64, _i64, _i64, _i64, _i64, _p, _p]
    _lib.dtkv_verify_scatter.restype = ctypes.c_int64
    _lib.dtkv_decode_batch.argtypes = [_p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _i64, _p, _p, _p, _p, _p, _i64, _p]
    _lib.dtkv_decode_batch.restype = None
    _lib.dtkv_decode_ptrs.argtypes = [_p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _p, _p, _p, _p, _i64, _p]
    _lib.dtkv_decode_ptrs.restype = None
    _lib.dtkv_verify_batch.argtypes = [_p, _i64, _i64, _i64, _p, _p, _p, _p, _i64, _p]
    _lib.dtkv_verify_batch.restype = None
    AVAILABLE = True
    UNAVAILABLE_REASON = ""
except (ImportError, OSError, AttributeError) as e:  # no compiler at install time, or a broken build
    AVAILABLE = False
    UNAVAILABLE_REASON = f"{type(e).__name__}: {e}"
    # Loud on purpose: the Python path is several times slower per block, which shows up as
    # slower saves and restores rather than as an error (gauge dtkv_codec_fast_path is 0).
    log.warning("compiled codec helper _fastcodec unavailable (%s); CPU-layout encode/decode uses the "
                "slower Python path. Reinstall with a C compiler present to build it.", UNAVAILABLE_REASON)


#: XXH3 loops the helper may run, by the index the C side uses
XXH3_VARIANTS = ("baseline", "avx2", "avx512")


def xxh3_variant() -> str:
    """The XXH3 loop the helpers chose for this CPU at load (the widest it runs)."""
    return XXH3_VARIANTS[int(_lib.dtkv_xxh3_best())]


def xxh3_64(data: bytes | np.ndarray, variant: str | None = None) -> int:
    """XXH3-64 (seed 0) as the compiled helpers compute it; equal to ``xxhash.xxh3_64_intdigest``.

    ``variant`` (tests, benchmarks): one of ``XXH3_VARIANTS`` up to ``xxh3_variant()``."""
    buf = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else np.ascontiguousarray(data).view(np.uint8)
    if variant is None:
        return int(_lib.dtkv_xxh3_64(buf.ctypes.data, buf.nbytes))
    v = XXH3_VARIANTS.index(variant)
    if v > int(_lib.dtkv_xxh3_best()):
        raise ValueError(f"this CPU does not run the {variant} XXH3 loop (best: {xxh3_variant()})")
    return int(_lib.dtkv_xxh3_64_variant(v, buf.ctypes.data, buf.nbytes))


class LayerTable:
    """Engine layer geometry in the form the C helpers take (built once per layout).

    ``geom`` is the argument run every helper starts with: the layer
    pointer table, layer count, planes per layer, block stride, plane stride, plane bytes.
    """

    __slots__ = ("geom", "ptrs")

    def __init__(self, layer_views: list[np.ndarray]) -> None:
        v0 = layer_views[0]
        if any(v.strides != v0.strides or v.shape != v0.shape for v in layer_views):
            raise ValueError("layer views differ in geometry")
        if v0.strides[2] != 1:
            raise ValueError("plane bytes must be contiguous")
        if len(layer_views) > MAX_LAYERS:
            raise ValueError(f"more than {MAX_LAYERS} layers")
        self.ptrs = np.array([v.ctypes.data for v in layer_views], dtype=np.uint64)  # kept alive here
        planes, plane_bytes = int(v0.shape[1]), int(v0.shape[2])
        block_stride, plane_stride = int(v0.strides[0]), int(v0.strides[1])
        self.geom = (self.ptrs.ctypes.data, len(layer_views), planes, block_stride, plane_stride, plane_bytes)


def gather_hash(
    t: LayerTable, block_ids: np.ndarray, dst: np.ndarray, record_bytes: int, header_bytes: int, sums: np.ndarray
) -> None:
    """Gather ``block_ids`` into records at ``record_bytes`` stride; per-layer XXH3 into ``sums``."""
    _lib.dtkv_gather_hash(
        *t.geom,
        block_ids.ctypes.data,
        len(block_ids),
        dst.ctypes.data,
        record_bytes,
        header_bytes,
        sums.ctypes.data,
    )


def verify_scatter(t: LayerTable, block_id: int, payload: np.ndarray, sums: np.ndarray) -> int:
    """-1 if every layer verified and was copied, else the first failing layer."""
    return int(_lib.dtkv_verify_scatter(*t.geom, block_id, payload.ctypes.data, sums.ctypes.data))


MAX_LAYERS = 1024  # DTKV_MAX_FAST_LAYERS in fastcodec.c; larger models take the Python path

# status codes of decode_batch and verify_batch (negative; a value >= 0 is the first layer that failed
# its checksum). UNSUPPORTED: more layers than MAX_LAYERS; SEALED: the payload is encrypted for its tenant
OK, BAD_MAGIC, BAD_VERSION, HEADER_CORRUPT, NAMESPACE, KEY, LAYOUT = -1, -2, -3, -4, -5, -6, -7
UNSUPPORTED, SEALED = -8, -9


def decode_batch(
    t: LayerTable,
    records: np.ndarray,
    record_bytes: int,
    header_bytes: int,
    expect_prefix: bytes,
    expect_desc: bytes,
    namespace: bytes,
    keys: bytes,
    block_ids: np.ndarray,
    status: np.ndarray,
) -> None:
    """Verify and scatter records laid back to back; fills ``status`` with the codes above."""
    _lib.dtkv_decode_batch(
        *t.geom,
        records.ctypes.data,
        record_bytes,
        header_bytes,
        expect_prefix,
        expect_desc,
        namespace,
        keys,
        block_ids.ctypes.data,
        len(block_ids),
        status.ctypes.data,
    )


def decode_ptrs(
    t: LayerTable,
    ptrs: np.ndarray,
    header_bytes: int,
    expect_prefix: bytes,
    expect_desc: bytes,
    namespace: bytes,
    keys: bytes,
    block_ids: np.ndarray,
    status: np.ndarray,
) -> None:
    """``decode_batch`` over records at the addresses ``ptrs`` (uint64), e.g. read in place."""
    _lib.dtkv_decode_ptrs(
        *t.geom,
        ptrs.ctypes.data,
        header_bytes,
        expect_prefix,
        expect_desc,
        namespace,
        keys,
        block_ids.ctypes.data,
        len(block_ids),
        status.ctypes.data,
    )


def verify_batch(
    records: Sequence[np.ndarray],
    num_layers: int,
    layer_bytes: int,
    header_bytes: int,
    expect_prefix: bytes,
    expect_desc: bytes,
    namespace: bytes,
    keys: bytes,
) -> np.ndarray:
    """``decode_batch``'s checks without the scatter (records bound for a device copy): header, identity,
    layout and every layer's checksum of each record, in one call that runs without the GIL (threads
    verifying other records meanwhile run in parallel). Returns one status per record (codes above).

    ``records``: contiguous uint8 arrays, each holding at least the header and ``num_layers`` layers
    (checked here: the helper reads that much of each); ``keys``: the expected 16-byte keys, joined."""
    n = len(records)
    need = header_bytes + num_layers * layer_bytes
    if len(keys) != 16 * n or len(namespace) != 16 or len(expect_prefix) != 16 or len(expect_desc) != 48:
        raise ValueError("verify_batch needs a 16-byte namespace, prefix and key per record and a 48-byte descriptor")
    for r in records:
        if r.dtype != np.uint8 or not r.flags.c_contiguous or r.nbytes < need:
            raise ValueError(f"every record must be a contiguous uint8 buffer of at least {need} bytes")
    ptrs = np.fromiter((r.ctypes.data for r in records), np.uint64, n)
    status = np.empty(n, np.int64)
    _lib.dtkv_verify_batch(ptrs.ctypes.data, num_layers, layer_bytes, header_bytes, expect_prefix, expect_desc,
                           namespace, keys, n, status.ctypes.data)
    return status
