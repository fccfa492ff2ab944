"""Block identity: a namespace digest and chained prefix keys.

Everything here is a pure function of its inputs (BLAKE2b, fixed byte encodings, no
per-process seed such as Python's ``hash()``), so two processes or two machines computing
the key of the same prefix get the same 16 bytes, and any node can find another node's blocks.

* ``Namespace`` pins what makes KV bytes interchangeable: model id, KV dtype, engine layout,
  block size, layer count, KV heads, head size, TP rank and size, pipeline stage and stage
  count (two stages hold different layers of the same shape), and the tenant salt.
* A block key is ``H(namespace, parent_key, block content)`` where the content is either the
  block's token ids or an engine-supplied block hash (vLLM hands requests their block hashes).
  Chaining the parent makes the key name the whole prefix, not just the block's tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)  # parent of the first block of every sequence
_NS_PERSON = b"dtkv-ns-v2"  # v2: scope fields length-prefixed (see scope_salt)
_KEY_PERSON = b"dtkv-key-v2"
_TOKENS_TAG = b"T"
_ENGINE_HASH_TAG = b"E"

BlockKey = bytes  # always KEY_BYTES long


def _h16(person: bytes) -> hashlib._Hash:  # type: ignore[name-defined]
    return hashlib.blake2b(digest_size=KEY_BYTES, person=person)


def _put_str(h: hashlib._Hash, s: str) -> None:  # type: ignore[name-defined]
    b = s.encode()
    h.update(struct.pack("<I", len(b)))
    h.update(b)


@dataclass(frozen=True)
class Namespace:
    """What must match for stored KV bytes to be reusable by an engine."""

    model_id: str
    kv_dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant_salt: str = field(default="", repr=False)
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size", "tp_size", "pp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Namespace.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"Namespace.tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"Namespace.pp_rank {self.pp_rank} outside [0, {self.pp_size})")

    @property
    def digest(self) -> bytes:
        """16-byte digest of every field (cached on first use)."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            h = _h16(_NS_PERSON)
            for s in (self.model_id, self.kv_dtype, self.layout, self.tenant_salt):
                _put_str(h, s)
            h.update(
                struct.pack(
                    "<8q",
                    self.block_size,
                    self.num_layers,
                    self.num_kv_heads,
                    self.head_size,
                    self.tp_rank,
                    self.tp_size,
                    self.pp_rank,
                    self.pp_size,
                )
            )
            cached = h.digest()
            object.__setattr__(self, "_digest", cached)
        return cached

    def hex(self) -> str:
        return self.digest.hex()


def scope_salt(tenant: str, **scopes: str | None) -> str:
    """One salt string from the tenant salt and per-request scopes (cache salt, LoRA, epoch).

    Every field is written as ``name=<length>:<value>;`` in name order, so no value can be
    crafted to look like another field: ``cache="X\\0lora:a"`` and ``cache="X", lora="a"``
    encode differently (the v1 concatenation made them equal). Empty or None scopes are left out,
    so a request with no scope keeps the tenant's plain namespace.
    """
    fields = {"tenant": tenant, **{k: v for k, v in scopes.items() if v}}
    return "".join(f"{k}={len(v)}:{v};" for k, v in sorted(fields.items()))


def _tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("block tokens must be a 1-D sequence")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def block_key(namespace: Namespace, parent: BlockKey, tokens: Sequence[int] | np.ndarray) -> BlockKey:
    """Key of one block from its parent's key and its own token ids."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes")
    h = _h16(_KEY_PERSON)
    h.update(namespace.digest)
    h.update(parent)
    h.update(_TOKENS_TAG)
    h.update(_tokens_bytes(tokens))
    return h.digest()


def engine_block_key(namespace: Namespace, parent: BlockKey, engine_hash: bytes | int) -> BlockKey:
    """Key of one block from an engine-supplied block hash (already chained by the engine).

    The parent is still mixed in so keys from the two schemes never alias, and the namespace
    makes the engine's hash tenant- and layout-specific.
    """
    if isinstance(engine_hash, int):
        engine_hash = engine_hash.to_bytes(32, "little", signed=engine_hash < 0)
    h = _h16(_KEY_PERSON)
    h.update(namespace.digest)
    h.update(parent)
    h.update(_ENGINE_HASH_TAG)
    h.update(engine_hash)
    return h.digest()


def chain_keys(namespace: Namespace, token_ids: Sequence[int] | np.ndarray) -> list[BlockKey]:
    """Keys of every *full* block of a token sequence, in order (a partial tail has no key)."""
    arr = np.asarray(token_ids)
    bs = namespace.block_size
    keys: list[BlockKey] = []
    parent = ROOT_KEY
    for i in range(len(arr) // bs):
        parent = block_key(namespace, parent, arr[i * bs : (i + 1) * bs])
        keys.append(parent)
    return keys


def chain_engine_keys(namespace: Namespace, engine_hashes: Iterable[bytes | int]) -> list[BlockKey]:
    """Keys for a request's engine-supplied block hash chain, in order."""
    keys: list[BlockKey] = []
    parent = ROOT_KEY
    for eh in engine_hashes:
        parent = engine_block_key(namespace, parent, eh)
        keys.append(parent)
    return keys


def parents_of(keys: Sequence[BlockKey]) -> list[BlockKey]:
    """Parent key of each key in a chain (ROOT_KEY for the first)."""
    return [ROOT_KEY, *keys[:-1]] if keys else []
