"""The compiled verify-only batch (``fast.verify_batch``, C ``dtkv_verify_batch``): it accepts exactly
the records ``codec.verify_record`` accepts for the engine's shape, namespace and keys, names each
refusal with ``decode_batch``'s status codes, record by record in a mixed batch, and never reads
past a record it was not given."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from dynamo_tiered_kv._native import fast
from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.blocks.sealed import seal_record
from dynamo_tiered_kv.errors import (
    BadMagic,
    ChecksumMismatch,
    HeaderCorrupt,
    KeyMismatch,
    LayoutMismatch,
    NamespaceMismatch,
    RecordError,
    RecordSealed,
    UnsupportedVersion,
)
from dynamo_tiered_kv.tenants.cipher import SEAL_BYTES, RecordCipher

NS = Namespace("m", "bf16", "FLASH_ATTN", 4, 3, 2, 8)
OTHER_NS = Namespace("other", "bf16", "FLASH_ATTN", 4, 3, 2, 8)

pytestmark = pytest.mark.skipif(not fast.AVAILABLE, reason=f"compiled codec helper not built: "
                                                           f"{fast.UNAVAILABLE_REASON}")


def _layout(seed: int, *, heads: int = 2, layers: int = 3) -> EngineLayout:
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=layers, num_blocks=10, block_size=4,
                            num_kv_heads=heads, head_size=8)
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8, generator=g))
    return EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 4, heads, 8)


def _records(n: int, seed: int = 1) -> tuple[EngineLayout, list[np.ndarray], list[bytes]]:
    src = _layout(seed)
    keys = chain_keys(NS, range(4 * n))
    rb = codec.record_bytes(src.shape)
    buf = np.zeros(n * rb, np.uint8)
    codec.encode_blocks(src, list(range(n)), [NS.digest] * n, keys, parents_of(keys), buf)
    return src, [buf[i * rb:(i + 1) * rb].copy() for i in range(n)], keys


def _native(recs: list[np.ndarray], keys: list[bytes], layout: EngineLayout, namespace: bytes = NS.digest) -> list[int]:
    shape = layout.shape
    prefix, desc = codec._descriptor(shape, layout.kind)
    status = fast.verify_batch(recs, shape.num_layers, shape.layer_bytes, codec.header_bytes(shape.num_layers),
                               prefix, desc, namespace, b"".join(keys))
    return status.tolist()


def _python(rec: np.ndarray, key: bytes, layout: EngineLayout, namespace: bytes = NS.digest) -> type | None:
    try:
        codec._verify_to_serve(rec, namespace, key, layout.shape)
        return None
    except RecordError as e:
        return type(e)


def _flip(at: Callable[[EngineLayout], int]) -> Callable[[np.ndarray, EngineLayout], None]:
    def corrupt(rec: np.ndarray, layout: EngineLayout) -> None:
        rec[at(layout)] ^= 0x01
    return corrupt


HB = codec.header_bytes(3)
# kind -> (corrupt the record in place, the status verify_batch gives, the error verify_record raises)
CORRUPTIONS: dict[str, tuple[Callable[[np.ndarray, EngineLayout], None], int, type]] = {
    "payload byte, layer 0": (_flip(lambda lay: HB + 5), 0, ChecksumMismatch),
    "payload byte, last layer": (_flip(lambda lay: HB + 3 * lay.shape.layer_bytes - 1), 2, ChecksumMismatch),
    "magic": (_flip(lambda lay: 3), fast.BAD_MAGIC, BadMagic),
    "version": (_flip(lambda lay: 8), fast.BAD_VERSION, UnsupportedVersion),
    "header byte (parent)": (_flip(lambda lay: 50), fast.HEADER_CORRUPT, HeaderCorrupt),
    "header byte (tenant)": (_flip(lambda lay: 115), fast.HEADER_CORRUPT, HeaderCorrupt),
    "checksum table byte": (_flip(lambda lay: 128 + 8 + 3), fast.HEADER_CORRUPT, HeaderCorrupt),
}


def test_good_records_pass_as_verify_record_passes_them() -> None:
    src, recs, keys = _records(4)
    assert _native(recs, keys, src) == [fast.OK] * 4
    assert [_python(r, k, src) for r, k in zip(recs, keys, strict=True)] == [None] * 4


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_each_corruption_is_refused_with_its_status(kind: str) -> None:
    src, recs, keys = _records(1)
    corrupt, status, error = CORRUPTIONS[kind]
    corrupt(recs[0], src)
    assert _native(recs, keys, src) == [status]
    assert _python(recs[0], keys[0], src) is error


def test_a_wrong_key_a_wrong_namespace_and_a_wrong_layout_are_refused() -> None:
    src, recs, keys = _records(2)
    wrong_keys = [keys[1], keys[0]]
    assert _native(recs, wrong_keys, src) == [fast.KEY, fast.KEY]
    assert _python(recs[0], wrong_keys[0], src) is KeyMismatch
    assert _native(recs, keys, src, OTHER_NS.digest) == [fast.NAMESPACE] * 2
    assert _python(recs[0], keys[0], src, OTHER_NS.digest) is NamespaceMismatch
    other = _layout(3, heads=4)  # same layers, larger blocks: the records padded to its record size
    padded = [np.concatenate([r, np.zeros(codec.record_bytes(other.shape) - r.nbytes, np.uint8)]) for r in recs]
    assert _native(padded, keys, other) == [fast.LAYOUT] * 2
    assert _python(recs[0], keys[0], other) is LayoutMismatch


def test_a_mixed_batch_gets_one_status_per_record() -> None:
    src, recs, keys = _records(8)
    kinds = ["payload byte, last layer", "magic", "header byte (parent)"]
    for i, kind in zip((1, 4, 6), kinds, strict=True):
        CORRUPTIONS[kind][0](recs[i], src)
    want_keys = list(keys)
    want_keys[2] = keys[3]  # record 2 is not the block asked for
    got = _native(recs, want_keys, src)
    assert got == [fast.OK, 2, fast.KEY, fast.OK, fast.BAD_MAGIC, fast.OK, fast.HEADER_CORRUPT, fast.OK]
    for i, (r, k) in enumerate(zip(recs, want_keys, strict=True)):  # OK exactly where Python accepts
        assert (got[i] == fast.OK) == (_python(r, k, src) is None), i


def test_a_sealed_record_is_refused_before_its_layers() -> None:
    src, recs, keys = _records(2)
    seal_record(recs[1], RecordCipher(lambda tenant, create: bytes(range(32))), SEAL_BYTES)
    assert _native(recs, keys, src) == [fast.OK, fast.SEALED]
    assert _python(recs[1], keys[1], src) is RecordSealed


def test_layers_past_the_helpers_limit_are_left_to_python() -> None:
    n, lb = fast.MAX_LAYERS + 1, 64
    hb = codec.header_bytes(n)
    rec = np.zeros(hb + n * lb, np.uint8)
    status = fast.verify_batch([rec], n, lb, hb, bytes(16), bytes(48), bytes(16), bytes(16))
    assert status.tolist() == [fast.UNSUPPORTED]


def test_short_or_strided_records_are_refused_before_the_helper_reads_them() -> None:
    src, recs, keys = _records(2)
    shape = src.shape
    prefix, desc = codec._descriptor(shape, src.kind)
    args = (shape.num_layers, shape.layer_bytes, codec.header_bytes(shape.num_layers), prefix, desc, NS.digest)
    short = recs[0][:codec.header_bytes(shape.num_layers) + 10]
    with pytest.raises(ValueError, match="at least"):
        fast.verify_batch([short], *args, keys[0])
    strided = np.repeat(recs[0], 2)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        fast.verify_batch([strided], *args, keys[0])
    with pytest.raises(ValueError, match="16-byte"):
        fast.verify_batch(recs, *args, keys[0])  # one key for two records
