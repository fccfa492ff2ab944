"""Deterministic valid records for tests (tiers that recover by scanning need real headers)."""

from __future__ import annotations

import hashlib

import numpy as np

from ..bench._keys import random_key
from ..blocks.codec import encode_payload, record_bytes
from ..blocks.keys import KEY_BYTES, ROOT_KEY
from ..blocks.layout import BlockShape, CanonicalFormat, DType
from ..blocks.tenant import DEFAULT_TENANT

__all__ = ["TEST_NAMESPACE", "make_record", "random_key", "small_shape"]

TEST_NAMESPACE = hashlib.blake2b(b"dtkv-test-namespace", digest_size=KEY_BYTES).digest()


def small_shape(
    num_layers: int = 2, block_size: int = 16, kv_heads: int = 2, head_size: int = 32, dtype: DType = DType.BFLOAT16
) -> BlockShape:
    return BlockShape(CanonicalFormat.KV_SPLIT, dtype, num_layers, block_size, kv_heads, head_size)


def make_record(
    key: bytes,
    seed: int = 0,
    *,
    shape: BlockShape | None = None,
    parent: bytes = ROOT_KEY,
    namespace: bytes = TEST_NAMESPACE,
    tenant: bytes = DEFAULT_TENANT,
) -> bytes:
    """A valid encoded record of ``tenant`` whose payload is derived from ``seed``."""
    shape = shape or small_shape()
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, shape.payload_bytes, dtype=np.uint8)
    out = np.zeros(record_bytes(shape), dtype=np.uint8)
    encode_payload(payload, shape, namespace, key, parent, out, tenant=tenant)
    return out.tobytes()
