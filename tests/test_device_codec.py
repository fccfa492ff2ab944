"""Records built and verified in device memory equal the host codec's, byte for byte.

CPU tensors stand in for the device here; the ``gpu`` tests repeat the checks on CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.device_codec import decode_blocks_on_device, encode_blocks_on_device
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.errors import ChecksumMismatch, HeaderCorrupt, KeyMismatch, NamespaceMismatch

NS = Namespace("m", "bf16", "KV_SPLIT", 16, 3, 2, 64)
IDS = [7, 0, 3, 8, 5]


def engine(kind: EngineLayoutKind, device: str, seed: int) -> EngineLayout:
    heads = 1 if kind is EngineLayoutKind.MLA else 2
    ts = allocate_engine_kv(kind, num_layers=3, num_blocks=9, block_size=16, num_kv_heads=heads, head_size=64,
                            device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for t in ts:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g, device=device))
    return EngineLayout(kind, ts, 16, heads, 64)


def on_cpu(lay: EngineLayout) -> EngineLayout:
    return EngineLayout(lay.kind, [t.cpu() for t in lay.tensors], 16, lay.shape.num_kv_heads, 64)


def block_bytes(lay: EngineLayout, b: int) -> list[bytes]:
    return [bytes(np.asarray(v[b].cpu() if isinstance(v, torch.Tensor) else v[b]).tobytes())
            for v in lay.layer_views]


def check_round_trip(kind: EngineLayoutKind, device: str) -> None:
    src = engine(kind, device, seed=1)
    keys = chain_keys(NS, range(16 * len(IDS)))
    parents = parents_of(keys)
    rb = codec.record_bytes(src.shape)
    ref = np.zeros(rb * len(IDS), np.uint8)
    codec.encode_blocks(on_cpu(src), IDS, [NS.digest] * len(IDS), keys, parents, ref)
    out = torch.full((rb * len(IDS) + 4096,), 0xEE, dtype=torch.uint8, device=device)
    assert encode_blocks_on_device(src, IDS, [NS.digest] * len(IDS), keys, parents, out) == rb * len(IDS)
    assert np.array_equal(out[:rb * len(IDS)].cpu().numpy(), ref), "device records differ from host records"

    dst = engine(kind, device, seed=2)
    targets = [1, 2, 4, 6, 8]
    assert decode_blocks_on_device(out, dst, targets, namespace=NS.digest, keys=keys) == [None] * len(IDS)
    for s, d in zip(IDS, targets):
        assert block_bytes(src, s) == block_bytes(dst, d)


@pytest.mark.parametrize("kind", list(EngineLayoutKind))
def test_device_records_match_host_records_and_round_trip(kind: EngineLayoutKind) -> None:
    check_round_trip(kind, "cpu")


def test_bad_records_are_reported_and_never_scattered() -> None:
    src = engine(EngineLayoutKind.FLASH_ATTN, "cpu", seed=3)
    keys = chain_keys(NS, range(16 * len(IDS)))
    rb, hb = codec.record_bytes(src.shape), codec.header_bytes(3)
    out = torch.zeros(rb * len(IDS), dtype=torch.uint8)
    encode_blocks_on_device(src, IDS, [NS.digest] * len(IDS), keys, parents_of(keys), out)
    out[1 * rb + hb + 2 * src.shape.layer_bytes + 17] ^= 0x40  # record 1, layer 2
    out[3 * rb + 40] ^= 0x01  # record 3: inside the header's key field
    dst = engine(EngineLayoutKind.FLASH_ATTN, "cpu", seed=4)
    before = {b: block_bytes(dst, b) for b in range(9)}
    targets = [1, 2, 4, 6, 8]
    errs = decode_blocks_on_device(out, dst, targets, namespace=NS.digest, keys=keys)
    assert errs[0] is None and errs[2] is None and errs[4] is None
    assert isinstance(errs[1], ChecksumMismatch) and "layer 2" in str(errs[1])
    assert isinstance(errs[3], HeaderCorrupt)
    assert block_bytes(dst, 2) == before[2] and block_bytes(dst, 6) == before[6], "a rejected record was copied"
    assert block_bytes(dst, 1) == block_bytes(src, IDS[0]) and block_bytes(dst, 8) == block_bytes(src, IDS[4])


def test_identity_is_checked() -> None:
    src = engine(EngineLayoutKind.FLASH_ATTN, "cpu", seed=5)
    keys = chain_keys(NS, range(32))
    rb = codec.record_bytes(src.shape)
    out = torch.zeros(rb * 2, dtype=torch.uint8)
    encode_blocks_on_device(src, [0, 1], [NS.digest] * 2, keys, parents_of(keys), out)
    other = Namespace("m", "bf16", "KV_SPLIT", 16, 3, 2, 64, tenant_salt="other").digest
    errs = decode_blocks_on_device(out, src, [2, 3], namespace=other, keys=keys)
    assert all(isinstance(e, NamespaceMismatch) for e in errs)
    errs = decode_blocks_on_device(out, src, [2, 3], namespace=NS.digest, keys=[keys[1], keys[0]])
    assert all(isinstance(e, KeyMismatch) for e in errs)


def test_bad_arguments_are_refused() -> None:
    src = engine(EngineLayoutKind.FLASH_ATTN, "cpu", seed=6)
    keys = chain_keys(NS, range(16))
    rb = codec.record_bytes(src.shape)
    short = torch.zeros(rb - 4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="need"):
        encode_blocks_on_device(src, [0], [NS.digest], keys, parents_of(keys), short)
    with pytest.raises(ValueError, match="uint8"):
        encode_blocks_on_device(src, [0], [NS.digest], keys, parents_of(keys), torch.zeros(rb, dtype=torch.int32))
    with pytest.raises(IndexError):
        encode_blocks_on_device(src, [9], [NS.digest], keys, parents_of(keys), torch.zeros(rb, dtype=torch.uint8))
    with pytest.raises(IndexError):
        decode_blocks_on_device(torch.zeros(rb, dtype=torch.uint8), src, [-1], namespace=NS.digest, keys=keys)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [EngineLayoutKind.FLASH_ATTN, EngineLayoutKind.MLA])
def test_device_records_on_cuda(kind: EngineLayoutKind) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_round_trip(kind, "cuda")
