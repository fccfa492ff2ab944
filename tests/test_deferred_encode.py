"""Offload encoding in two halves (``deferred_encode``): the engine thread's part and the writer's.

CPU layouts encode in one pass now; a CUDA engine's copy is queued on a side stream, ordered
after the forward and before any later kernel, and the checksums run on the store's writer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_store import NS, REC, keys_for, make_layout, make_store, pool  # noqa: F401 - pool is a fixture

from dynamo_tiered_kv.blocks.codec import decode_blocks, encode_blocks, record_bytes
from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.store import writes as store_writes
from dynamo_tiered_kv.store.deferred_encode import begin_encode
from dynamo_tiered_kv.tiers.host import HostTier


def test_cpu_layout_encodes_at_once_and_matches_encode_blocks() -> None:
    layout, keys = make_layout(seed=3), keys_for(3)
    a, b = np.zeros(3 * REC, np.uint8), np.zeros(3 * REC, np.uint8)
    seal = begin_encode(layout, [2, 5, 7], [NS.digest] * 3, keys, parents_of(keys), a)
    assert a.any()  # already written: the CPU pass is fused, nothing is left for the writer
    assert seal() == 3 * REC
    encode_blocks(layout, [2, 5, 7], [NS.digest] * 3, keys, parents_of(keys), b)
    assert np.array_equal(a, b)


def test_bad_arguments_raise_on_the_calling_thread() -> None:
    layout, keys = make_layout(), keys_for(2)
    with pytest.raises(ValueError):
        begin_encode(layout, [1, 2], [NS.digest] * 2, keys, parents_of(keys), np.zeros(REC, np.uint8))


def test_a_failing_second_half_drops_the_batch_and_frees_the_slab(pool, monkeypatch) -> None:  # noqa: F811
    def failing(*a, **kw):
        def seal() -> int:
            raise RuntimeError("device copy failed")

        return seal

    monkeypatch.setattr(store_writes, "begin_encode", failing)
    keys = keys_for(2)
    with make_store([HostTier(64 * REC, chunk_bytes=REC, pin=False)], pool) as store:
        free = pool.free_count
        assert store.submit_offload(make_layout(seed=1), [1, 2], keys, parents_of(keys))
        assert store.drain(10)
        assert store.lookup(keys).num_blocks == 0  # nothing half-encoded reached a tier
        assert pool.free_count == free
        assert store.metrics.offload_dropped.labels("encode_error")._value.get() == 1


@pytest.mark.gpu
def test_cuda_copy_is_ordered_between_the_forward_and_later_kernels() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=4, num_blocks=32, block_size=16,
                            num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda")
    layout = EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 16, 8, 128)
    rb = record_bytes(layout.shape)
    keys = keys_for(4)
    ids = [3, 9, 17, 30]
    for t in ts:  # "the forward": written on the engine's stream just before the save
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    want = [t.clone() for t in ts]
    slab = torch.empty(4 * rb, dtype=torch.uint8).pin_memory().numpy()
    seal = begin_encode(layout, ids, [NS.digest] * 4, keys, parents_of(keys), slab)
    idx = torch.tensor(ids, device="cuda")
    for t in ts:  # a later request reuses the blocks (FLASH_ATTN: blocks on dim 1): must not reach the records
        t.index_fill_(1, idx, 0)
    assert seal() == 4 * rb
    cpu = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=4, num_blocks=32, block_size=16,
                             num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    out = EngineLayout(EngineLayoutKind.FLASH_ATTN, cpu, 16, 8, 128)
    errors = decode_blocks(slab, out, ids, namespace=NS.digest, keys=keys)
    assert not any(errors)
    for c, w in zip(cpu, want):
        assert torch.equal(c[:, ids], w[:, ids].cpu())
