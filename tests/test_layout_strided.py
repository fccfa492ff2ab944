"""vLLM's HND KV cache layout (``VLLM_KV_CACHE_LAYOUT=HND``, FlashInfer on Blackwell): the tensors
keep the logical NHD shape over memory ordered [block][heads][tokens][dim], so they are not
contiguous. They map to the same canonical records as NHD (restorable across the two), on the
host path and through the CUDA path's movers, checked here with CPU tensors and ``.permute`` views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind
from dynamo_tiered_kv.errors import LayoutMismatch

NS = Namespace("m", "bf16", "FLASH_ATTN", 4, 3, 2, 8)
NB, BS, H, D, L = 10, 4, 2, 8, 3


def _hnd(kind: EngineLayoutKind, nhd: torch.Tensor) -> torch.Tensor:
    """The same values in HND memory order, with the NHD logical shape (as vLLM builds them)."""
    if kind is EngineLayoutKind.FLASH_ATTN:
        phys = torch.empty(2, NB, H, BS, D, dtype=nhd.dtype)
    else:
        phys = torch.empty(NB, 2, H, BS, D, dtype=nhd.dtype)
    t = phys.permute(0, 1, 3, 2, 4)
    t.copy_(nhd)
    assert not t.is_contiguous() and t.shape == nhd.shape
    return t


def _pair(kind: EngineLayoutKind, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (2, NB, BS, H, D) if kind is EngineLayoutKind.FLASH_ATTN else (NB, 2, BS, H, D)
    g = torch.Generator().manual_seed(seed)
    nhd = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(L)]
    return nhd, [_hnd(kind, t) for t in nhd]


def _vllm(ts: list[torch.Tensor]) -> EngineLayout:
    return EngineLayout.from_vllm({f"layer.{i}": t for i, t in enumerate(ts)}, BS, H, D)


@pytest.mark.parametrize("kind", [EngineLayoutKind.FLASH_ATTN, EngineLayoutKind.FLASHINFER])
def test_hnd_caches_encode_the_nhd_records_and_restore_across(kind: EngineLayoutKind) -> None:
    nhd, hnd = _pair(kind, 1)
    a, b = _vllm(nhd), _vllm(hnd)
    assert a.kind is b.kind is kind
    ids = [9, 0, 4]
    keys = chain_keys(NS, range(BS * len(ids)))
    rb = codec.record_bytes(a.shape)
    want, got = np.zeros(3 * rb, np.uint8), np.zeros(3 * rb, np.uint8)
    codec.encode_blocks(a, ids, [NS.digest] * 3, keys, parents_of(keys), want)
    codec.encode_blocks(b, ids, [NS.digest] * 3, keys, parents_of(keys), got)
    assert np.array_equal(got, want)
    _, fresh = _pair(kind, 2)
    c = _vllm(fresh)
    assert codec.decode_blocks(want, c, [1, 2, 3], namespace=NS.digest, keys=keys) == [None] * 3
    blk = 1 if kind is EngineLayoutKind.FLASH_ATTN else 0
    for src, dst in zip(nhd, fresh):
        assert torch.equal(dst.index_select(blk, torch.tensor([1, 2, 3])), src.index_select(blk, torch.tensor(ids)))


def test_hnd_through_the_cuda_movers(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_device_copy import _as_cuda
    from test_device_order import RecordingOps, _Stream

    from dynamo_tiered_kv.staging import device_copy

    ops = RecordingOps()
    monkeypatch.setattr(device_copy, "cuda_ops", lambda: ops)
    monkeypatch.setattr(device_copy, "_restore_stream", lambda device: _Stream(ops.g, "restore"))
    monkeypatch.setattr(device_copy, "_save_stream", lambda device: _Stream(ops.g, "side"))
    nhd, hnd = _pair(EngineLayoutKind.FLASH_ATTN, 3)
    ids = [5, 7]
    keys = chain_keys(NS, range(BS * len(ids)))
    rb = codec.record_bytes(_vllm(nhd).shape)
    want, got = np.zeros(2 * rb, np.uint8), np.zeros(2 * rb, np.uint8)
    codec.encode_blocks(_vllm(nhd), ids, [NS.digest] * 2, keys, parents_of(keys), want)
    codec.encode_blocks(_as_cuda(_vllm(hnd)), ids, [NS.digest] * 2, keys, parents_of(keys), got)
    assert np.array_equal(got, want)
    _, fresh = _pair(EngineLayoutKind.FLASH_ATTN, 4)
    assert codec.decode_blocks(want, _as_cuda(_vllm(fresh)), [0, 1], namespace=NS.digest, keys=keys) == [None] * 2
    for src, dst in zip(nhd, fresh):
        assert torch.equal(dst[:, [0, 1]], src[:, ids])


def test_a_strided_head_dimension_is_refused_with_a_clear_error() -> None:
    t = torch.zeros(2, NB, BS, D, H, dtype=torch.bfloat16).transpose(3, 4)  # head_size not contiguous
    with pytest.raises(LayoutMismatch, match="head dimension"):
        _vllm([t] * L)
