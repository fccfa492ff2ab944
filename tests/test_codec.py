"""Round trips through every engine layout and dtype, and detection of every kind of damage."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.keys import ROOT_KEY, Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.errors import (
    BadMagic,
    ChecksumMismatch,
    HeaderCorrupt,
    KeyMismatch,
    LayoutMismatch,
    NamespaceMismatch,
    RecordError,
    RecordTruncated,
    UnsupportedVersion,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
KINDS = list(EngineLayoutKind)


def make_layout(
    kind: EngineLayoutKind, dtype: torch.dtype, *, layers=3, blocks=6, bs=4, heads=2, hs=8, seed=0
) -> EngineLayout:
    if kind is EngineLayoutKind.MLA:
        heads = 1
    ts = allocate_engine_kv(
        kind, num_layers=layers, num_blocks=blocks, block_size=bs, num_kv_heads=heads, head_size=hs, dtype=dtype
    )
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return EngineLayout(kind, ts, bs, heads, hs)


def tensors_of(layout: EngineLayout) -> list[torch.Tensor]:
    return layout.tensors


NS = Namespace("m", "bf16", "KV_SPLIT", 4, 3, 2, 8)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(DTYPES),
    picks=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    dest_perm=st.randoms(),
)
def test_roundtrip_every_layout_and_dtype(kind, dtype, picks, dest_perm) -> None:
    src = make_layout(kind, dtype, seed=1)
    dst = make_layout(kind, dtype, seed=2)
    keys = chain_keys(NS, np.arange(len(picks) * 4))
    rb = codec.record_bytes(src.shape)
    out = np.zeros(rb * len(picks), np.uint8)
    assert codec.encode_blocks(src, picks, [NS.digest] * len(picks), keys, parents_of(keys), out) == out.nbytes
    targets = list(range(6))
    dest_perm.shuffle(targets)
    for i, (b, key) in enumerate(zip(picks, keys)):
        rec = out[i * rb : (i + 1) * rb]
        hdr = codec.decode_block(rec, dst, targets[i], namespace=NS.digest, key=key)
        assert hdr.parent == (ROOT_KEY if i == 0 else keys[i - 1])
        for layer in range(src.shape.num_layers):
            a = np.empty(src.shape.layer_bytes, np.uint8)
            c = np.empty_like(a)
            src.gather_layer(b, layer, a)
            dst.gather_layer(targets[i], layer, c)
            assert np.array_equal(a, c)


def test_flash_attn_and_flashinfer_share_the_canonical_record() -> None:
    fa = make_layout(EngineLayoutKind.FLASH_ATTN, torch.bfloat16, seed=3)
    fi = make_layout(EngineLayoutKind.FLASHINFER, torch.bfloat16, seed=4)
    key = chain_keys(NS, range(4))[0]
    rec = np.zeros(codec.record_bytes(fa.shape), np.uint8)
    codec.encode_block(fa, 2, NS.digest, key, ROOT_KEY, rec)
    codec.decode_block(rec, fi, 5, namespace=NS.digest, key=key)
    for layer, (tfa, tfi) in enumerate(zip(fa.tensors, fi.tensors)):
        assert torch.equal(tfa[:, 2].view(torch.uint8), tfi[5].view(torch.uint8)), layer
    # the canonical order is K then V, each [block_size, heads, head_size]
    payload = codec.payload_view(rec, namespace=NS.digest, key=key)
    k0 = payload[: fa.shape.layer_bytes // 2].view(np.uint16).reshape(4, 2, 8)
    assert np.array_equal(k0, fa.tensors[0][0, 2].view(torch.uint16).numpy())


def test_records_are_4k_aligned_and_layer_ranges_are_byte_ranges() -> None:
    lay = make_layout(EngineLayoutKind.FLASHINFER, torch.float16)
    rec = np.zeros(codec.record_bytes(lay.shape), np.uint8)
    key = chain_keys(NS, range(4))[0]
    codec.encode_block(lay, 0, NS.digest, key, ROOT_KEY, rec)
    assert rec.nbytes % 4096 == 0
    hdr = codec.decode_header(rec)
    off, length = hdr.layer_range(1, 2)
    assert off == hdr.header_bytes + lay.shape.layer_bytes and hdr.header_bytes % 4096 == 0
    assert np.array_equal(
        rec[off : off + length].view(np.uint8), lay.tensors[1][0].reshape(-1).view(torch.uint8).numpy()
    )
    # a layer range verifies on its own
    codec.verify_record(rec[: off + length], layers=(1, 2))


def _record() -> tuple[np.ndarray, bytes, EngineLayout]:
    lay = make_layout(EngineLayoutKind.FLASH_ATTN, torch.bfloat16, seed=5)
    key = chain_keys(NS, range(4))[0]
    rec = np.zeros(codec.record_bytes(lay.shape), np.uint8)
    codec.encode_block(lay, 1, NS.digest, key, ROOT_KEY, rec)
    return rec, key, lay


REC, KEY, LAY = _record()
USED = codec.header_bytes(LAY.shape.num_layers) + LAY.shape.payload_bytes
HEADER_USED = 128 + 8 * LAY.shape.num_layers


@settings(max_examples=300, deadline=None)
@given(
    pos=st.one_of(st.integers(0, HEADER_USED - 1), st.integers(codec.header_bytes(3), USED - 1)),
    flip=st.integers(1, 255),
)
def test_any_flipped_byte_is_detected(pos: int, flip: int) -> None:
    bad = REC.copy()
    bad[pos] ^= flip
    dst = make_layout(EngineLayoutKind.FLASH_ATTN, torch.bfloat16, seed=9)
    before = [t[:, 0].clone().view(torch.uint8) for t in dst.tensors]
    with pytest.raises(RecordError):
        codec.decode_block(bad, dst, 0, namespace=NS.digest, key=KEY)
    # only verified bytes reach the engine: each layer is either untouched or the original block
    for layer, (old, t) in enumerate(zip(before, dst.tensors)):
        now = t[:, 0].view(torch.uint8)
        good = LAY.tensors[layer][:, 1].view(torch.uint8)
        assert torch.equal(now, old) or torch.equal(now, good), layer


@given(cut=st.integers(0, USED - 1))
@settings(max_examples=100, deadline=None)
def test_truncation_is_detected(cut: int) -> None:
    with pytest.raises(RecordError):
        codec.verify_record(REC[:cut], namespace=NS.digest, key=KEY)


def test_error_classes() -> None:
    with pytest.raises(RecordTruncated):
        codec.verify_record(REC[:100])
    bad = REC.copy()
    bad[0] ^= 1
    with pytest.raises(BadMagic):
        codec.verify_record(bad)
    bad = REC.copy()
    bad[8] = 9
    with pytest.raises(UnsupportedVersion):
        codec.verify_record(bad)
    bad = REC.copy()
    bad[40] ^= 1
    with pytest.raises(HeaderCorrupt):
        codec.verify_record(bad)
    bad = REC.copy()
    bad[codec.header_bytes(3) + 5] ^= 1
    with pytest.raises(ChecksumMismatch):
        codec.verify_record(bad)
    with pytest.raises(NamespaceMismatch):
        codec.verify_record(REC, namespace=bytes(16))
    with pytest.raises(KeyMismatch):
        codec.verify_record(REC, key=bytes(16))
    other = make_layout(EngineLayoutKind.FLASH_ATTN, torch.float16)
    with pytest.raises(LayoutMismatch):
        codec.decode_block(REC, other, 0, namespace=NS.digest, key=KEY)
    cpu = make_layout(EngineLayoutKind.VLLM_CPU, torch.bfloat16)
    with pytest.raises(LayoutMismatch):  # opaque CPU packing never restores into a GPU layout
        codec.decode_block(REC, cpu, 0, namespace=NS.digest, key=KEY)


def test_layout_detection_from_vllm_shapes() -> None:
    for kind in (EngineLayoutKind.FLASH_ATTN, EngineLayoutKind.FLASHINFER, EngineLayoutKind.VLLM_CPU):
        ts = allocate_engine_kv(kind, num_layers=2, num_blocks=7, block_size=16, num_kv_heads=2, head_size=32)
        lay = EngineLayout.from_vllm({f"l{i}": t for i, t in enumerate(ts)}, 16, 2, 32)
        assert lay.kind is kind and lay.num_blocks == 7 and lay.shape.num_layers == 2
    ts = allocate_engine_kv(
        EngineLayoutKind.MLA, num_layers=2, num_blocks=7, block_size=16, num_kv_heads=1, head_size=576
    )
    assert EngineLayout.from_vllm({"a": ts[0], "b": ts[1]}, 16, 1, 576).kind is EngineLayoutKind.MLA
    with pytest.raises(LayoutMismatch):
        EngineLayout.from_vllm({"a": torch.zeros(3, 3)}, 16, 2, 32)
    with pytest.raises(LayoutMismatch):
        EngineLayout(EngineLayoutKind.FLASH_ATTN, [torch.zeros(2, 4, 16, 2, 32, dtype=torch.float64)], 16, 2, 32)


def test_output_buffer_too_small() -> None:
    with pytest.raises(ValueError, match="output buffer"):
        codec.encode_blocks(LAY, [0, 1], [NS.digest] * 2, [KEY, KEY], [ROOT_KEY] * 2, np.zeros(4096, np.uint8))


@pytest.mark.parametrize("kind", [EngineLayoutKind.FLASH_ATTN, EngineLayoutKind.VLLM_CPU, EngineLayoutKind.KVBM_FC])
def test_decode_blocks_isolates_bad_records(kind: EngineLayoutKind) -> None:
    src = make_layout(kind, torch.bfloat16, seed=11)
    dst = make_layout(kind, torch.bfloat16, seed=12)
    keys = chain_keys(NS, range(16))
    rb = codec.record_bytes(src.shape)
    buf = np.zeros(4 * rb, np.uint8)
    codec.encode_blocks(src, [0, 1, 2, 3], [NS.digest] * 4, keys, parents_of(keys), buf)
    buf[1 * rb + codec.header_bytes(3) + src.shape.layer_bytes + 3] ^= 0x40  # record 1, layer 1
    buf[2 * rb + 40] ^= 1  # record 2 header
    errs = codec.decode_blocks(buf, dst, [5, 4, 3, 2], namespace=NS.digest, keys=[keys[0], keys[1], keys[2], bytes(16)])
    assert errs[0] is None
    assert isinstance(errs[1], ChecksumMismatch) and "layer 1" in str(errs[1])
    assert isinstance(errs[2], HeaderCorrupt)
    assert isinstance(errs[3], KeyMismatch)
    for j in range(3):
        assert np.array_equal(np.asarray(dst.layer_views[j][5]), np.asarray(src.layer_views[j][0]))
    # record 1: layer 0 verified and copied, layer 1 rejected and not copied
    assert np.array_equal(np.asarray(dst.layer_views[0][4]), np.asarray(src.layer_views[0][1]))
    assert not np.array_equal(np.asarray(dst.layer_views[1][4]), np.asarray(src.layer_views[1][1]))


def test_python_and_compiled_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv._native import fast

    if not fast.AVAILABLE:
        pytest.skip("compiled helpers not built")
    lay = make_layout(EngineLayoutKind.FLASH_ATTN, torch.float16, seed=13)
    keys = chain_keys(NS, range(12))
    rb = codec.record_bytes(lay.shape)
    a = np.zeros(3 * rb, np.uint8)
    b = np.zeros(3 * rb, np.uint8)
    codec.encode_blocks(lay, [4, 0, 2], [NS.digest] * 3, keys, parents_of(keys), a)
    monkeypatch.setattr(lay, "_fast", None)  # force the pure-Python path
    codec.encode_blocks(lay, [4, 0, 2], [NS.digest] * 3, keys, parents_of(keys), b)
    assert np.array_equal(a, b)


def test_decode_blocks_cross_layout_and_identity_errors() -> None:
    fa = make_layout(EngineLayoutKind.FLASH_ATTN, torch.bfloat16, seed=21)
    fi = make_layout(EngineLayoutKind.FLASHINFER, torch.bfloat16, seed=22)
    keys = chain_keys(NS, range(8))
    rb = codec.record_bytes(fa.shape)
    buf = np.zeros(2 * rb, np.uint8)
    codec.encode_blocks(fa, [1, 2], [NS.digest] * 2, keys, parents_of(keys), buf)
    assert codec.decode_blocks(buf, fi, [3, 4], namespace=NS.digest, keys=keys) == [None, None]
    for j in range(3):
        assert np.array_equal(fi.layer_views[j][3].reshape(-1), fa.layer_views[j][1].reshape(-1))
    errs = codec.decode_blocks(buf, fi, [3, 4], namespace=bytes(16), keys=keys)
    assert all(isinstance(e, NamespaceMismatch) for e in errs)
    other = make_layout(EngineLayoutKind.FLASHINFER, torch.float16, seed=23)
    errs = codec.decode_blocks(buf, other, [3, 4], namespace=NS.digest, keys=keys)
    assert all(isinstance(e, LayoutMismatch) for e in errs)


def test_out_of_range_block_ids_refused_before_any_copy() -> None:
    lay = make_layout(EngineLayoutKind.FLASH_ATTN, torch.bfloat16, seed=31)
    keys = chain_keys(NS, range(4))
    rb = codec.record_bytes(lay.shape)
    buf = np.zeros(rb, np.uint8)
    for bad in (-1, lay.num_blocks):
        with pytest.raises(IndexError):
            codec.encode_blocks(lay, [bad], [NS.digest], keys, parents_of(keys), buf)
    codec.encode_blocks(lay, [0], [NS.digest], keys, parents_of(keys), buf)
    for bad in (-1, lay.num_blocks):
        with pytest.raises(IndexError):
            codec.decode_blocks(buf, lay, [bad], namespace=NS.digest, keys=keys)
        with pytest.raises(IndexError):
            codec.decode_block(buf, lay, bad, namespace=NS.digest, key=keys[0])


def test_layers_of_different_geometry_are_refused() -> None:
    a = torch.zeros(2, 64, 4, 2, 8, dtype=torch.bfloat16)
    b = torch.zeros(2, 4, 4, 2, 8, dtype=torch.bfloat16)  # fewer blocks: would let ids run past its end
    with pytest.raises(LayoutMismatch, match="differ across layers"):
        EngineLayout(EngineLayoutKind.FLASH_ATTN, [a, b], 4, 2, 8)


def test_decode_blocks_checks_key_lengths() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        codec.decode_blocks(REC, LAY, [0], namespace=NS.digest, keys=[b"short"])
