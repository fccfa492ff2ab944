"""Deterministic block keys for benchmarks (the same ``i`` and ``salt`` give the same key)."""

from __future__ import annotations

import hashlib

from ..blocks.keys import KEY_BYTES


def random_key(i: int, salt: bytes = b"") -> bytes:
    """A well-spread key-sized digest of ``salt`` and ``i``."""
    return hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=KEY_BYTES).digest()
