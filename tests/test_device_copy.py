"""The codec's CUDA branches (batched restore and save through ``device_copy``), run over CPU tensors
with a recording stand-in for the stream/event API: same code, same bytes, no GPU.

A layout is marked as CUDA and given torch views, as a CUDA layout has; the copies then take the
device path. One restore batch is one upload and one scatter, whatever its size, and a record that
fails verification never reaches the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_device_order import RecordingOps, _Stream

from dynamo_tiered_kv import kernels
from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.errors import ChecksumMismatch
from dynamo_tiered_kv.staging import device_copy

NS = Namespace("m", "bf16", "FLASH_ATTN", 4, 3, 2, 8)


def _layout(seed: int) -> EngineLayout:
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2,
                            head_size=8)
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8, generator=g))
    return EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 4, 2, 8)


def _as_cuda(layout: EngineLayout) -> EngineLayout:
    layout.is_cuda = True
    layout.layer_views = [torch.from_numpy(v) for v in layout.layer_views]
    return layout


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Stream/event calls recorded instead of made; returns the list of scatter batch sizes."""
    ops = RecordingOps()
    monkeypatch.setattr(device_copy, "cuda_ops", lambda: ops)
    monkeypatch.setattr(device_copy, "_restore_stream", lambda device: _Stream(ops.g, "restore"))
    monkeypatch.setattr(device_copy, "_save_stream", lambda device: _Stream(ops.g, "side"))
    sizes: list[int] = []
    real = kernels.scatter_records

    def counting(records, views, block_ids, **kw):
        sizes.append(int(block_ids.numel()))
        return real(records, views, block_ids, **kw)

    monkeypatch.setattr(kernels, "scatter_records", counting)
    return sizes


def _records(src: EngineLayout, ids: list[int]) -> tuple[np.ndarray, list[bytes]]:
    keys = chain_keys(NS, range(4 * len(ids)))
    buf = np.zeros(len(ids) * codec.record_bytes(src.shape), np.uint8)
    codec.encode_blocks(src, ids, [NS.digest] * len(ids), keys, parents_of(keys), buf)
    return buf, keys


def test_a_cuda_restore_batch_is_one_scatter_and_bad_records_never_land(fake_cuda: list[int]) -> None:
    src = _layout(1)
    ids = [0, 3, 5, 9]
    buf, keys = _records(src, ids)
    rb = codec.record_bytes(src.shape)
    buf[2 * rb + codec.header_bytes(3) + 7] ^= 1  # record 2's payload corrupt
    dst = _as_cuda(_layout(2))
    before = [v.clone() for v in dst.layer_views]
    targets = [1, 2, 4, 8]
    errors = codec.decode_blocks(buf, dst, targets, namespace=NS.digest, keys=keys)
    assert [type(e) for e in errors] == [type(None), type(None), ChecksumMismatch, type(None)]
    assert fake_cuda == [3]  # one scatter for the three good records
    for j in range(3):
        for s, t in zip(ids, targets):
            want = before[j][t] if t == 4 else torch.from_numpy(src.layer_views[j][s])
            assert torch.equal(dst.layer_views[j][t], want), (j, s, t)


def test_cuda_restore_of_scattered_records_is_packed_into_one_batch(fake_cuda: list[int]) -> None:
    src = _layout(3)
    buf, keys = _records(src, [2, 6])
    rb = codec.record_bytes(src.shape)
    recs = [buf[rb:2 * rb].copy(), buf[:rb].copy()]  # apart, and in another order
    dst = _as_cuda(_layout(4))
    assert codec.decode_records(recs, dst, [7, 0], namespace=NS.digest,
                                keys=[keys[1], keys[0]]) == [None, None]
    assert fake_cuda == [2]
    for j in range(3):
        assert torch.equal(dst.layer_views[j][7], torch.from_numpy(src.layer_views[j][6]))
        assert torch.equal(dst.layer_views[j][0], torch.from_numpy(src.layer_views[j][2]))


def test_cuda_encode_matches_the_cpu_records(fake_cuda: list[int]) -> None:
    src = _layout(5)
    ids = [9, 0, 4]
    want, keys = _records(src, ids)
    dev = _as_cuda(_layout(5))
    got = np.zeros_like(want)
    codec.encode_blocks(dev, ids, [NS.digest] * 3, keys, parents_of(keys), got)
    assert np.array_equal(got, want)
