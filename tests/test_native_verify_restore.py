"""The CUDA restore path's host verify through the compiled helper, on CPU tensors (a layout marked
CUDA, as in ``test_device_copy``): a chunk is verified with one ``fast.verify_batch`` call, not record
by record in Python; a refused record is a miss that never reaches the engine, with the error the
Python path names; without the helper the Python path gives the same results; and the store's read
pipeline spreads a CUDA chunk's verify over its decode threads while the chunk's copy stays one, on
the loading thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_device_copy import NS, _as_cuda, _layout, _records
from test_device_order import _Stream
from test_restore_order import CountingOps

import dynamo_tiered_kv.store.reads.fanout as fo
from dynamo_tiered_kv import kernels
from dynamo_tiered_kv._native import fast
from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.errors import ChecksumMismatch, HeaderCorrupt, KeyMismatch
from dynamo_tiered_kv.staging import device_copy
from dynamo_tiered_kv.staging.slabs import StagingPool
from tests.test_store import REC, block_bytes, make_layout
from tests.test_store_pipeline import PieceTier, _filled


class Seams:
    """Counts native verify calls (and the threads they ran on), per-record Python verifies, and the
    records each scatter launch (the device copy) carried and the thread that queued it; stream and
    event calls are recorded instead of made (``test_restore_order``'s stand-in)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.native: list[tuple[int, str]] = []
        self.python = 0
        self.scatters: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        real_native, real_python, real_scatter = fast.verify_batch, codec._verify_to_serve, kernels.scatter_records

        def native(records: Any, *a: Any) -> Any:
            with self._lock:
                self.native.append((len(records), threading.current_thread().name))
            return real_native(records, *a)

        def python(*a: Any, **kw: Any) -> Any:
            with self._lock:
                self.python += 1
            return real_python(*a, **kw)

        def scatter(records: Any, views: Any, block_ids: torch.Tensor, **kw: Any) -> Any:
            self.scatters.append((int(block_ids.numel()), threading.current_thread().name))
            return real_scatter(records, views, block_ids, **kw)

        monkeypatch.setattr(fast, "verify_batch", native)
        monkeypatch.setattr(codec, "_verify_to_serve", python)
        monkeypatch.setattr(kernels, "scatter_records", scatter)
        ops = CountingOps(keeps_up=True)
        monkeypatch.setattr(device_copy, "cuda_ops", lambda: ops)
        monkeypatch.setattr(device_copy, "_ops_for", lambda device: ops)
        monkeypatch.setattr(device_copy, "_device_ctx", ops.guard)
        monkeypatch.setattr(device_copy, "_restore_stream", lambda device: _Stream(ops.g, "restore"))


@pytest.fixture
def seams(monkeypatch: pytest.MonkeyPatch) -> Iterator[Seams]:
    if not fast.AVAILABLE:
        pytest.skip(f"compiled codec helper not built: {fast.UNAVAILABLE_REASON}")
    yield Seams(monkeypatch)


def _same(dst: Any, t: int, src: Any, s: int) -> bool:
    return all(torch.equal(dst.layer_views[j][t], torch.from_numpy(np.asarray(src.layer_views[j][s])))
               for j in range(3))


def test_a_cuda_chunk_is_verified_in_one_native_call(seams: Seams) -> None:
    src = _layout(1)
    ids = [0, 3, 5, 9, 2, 7]
    buf, keys = _records(src, ids)
    dst = _as_cuda(_layout(2))
    targets = [1, 2, 4, 8, 0, 6]
    assert codec.decode_blocks(buf, dst, targets, namespace=NS.digest, keys=keys) == [None] * 6
    assert [n for n, _ in seams.native] == [6] and seams.python == 0
    assert [n for n, _ in seams.scatters] == [6]
    assert all(_same(dst, t, src, s) for s, t in zip(ids, targets, strict=True))


def test_scattered_records_are_verified_in_one_native_call_too(seams: Seams) -> None:
    src = _layout(3)
    buf, keys = _records(src, [2, 6])
    rb = codec.record_bytes(src.shape)
    recs = [buf[rb:2 * rb].copy(), buf[:rb].copy()]
    dst = _as_cuda(_layout(4))
    assert codec.decode_records(recs, dst, [7, 0], namespace=NS.digest, keys=[keys[1], keys[0]]) == [None, None]
    assert [n for n, _ in seams.native] == [2] and seams.python == 0
    assert _same(dst, 7, src, 6) and _same(dst, 0, src, 2)


def _corrupt_chunk() -> tuple[Any, np.ndarray, list[bytes]]:
    """Five records: 1 with a flipped payload byte, 2 asked for under another key, 4 with a flipped
    header byte."""
    src = _layout(5)
    buf, keys = _records(src, [0, 1, 2, 3, 4])
    rb, hb = codec.record_bytes(src.shape), codec.header_bytes(3)
    buf[rb + hb + src.shape.layer_bytes + 3] ^= 0x10  # record 1, layer 1
    buf[4 * rb + 50] ^= 0x01  # record 4, its parent: the header checksum fails
    keys = list(keys)
    keys[2] = keys[3]
    return src, buf, keys


WANT = [type(None), ChecksumMismatch, KeyMismatch, type(None), HeaderCorrupt]


def test_corrupt_records_in_a_cuda_chunk_are_misses_and_never_reach_the_engine(seams: Seams) -> None:
    src, buf, keys = _corrupt_chunk()
    dst = _as_cuda(_layout(6))
    before = [v.clone() for v in dst.layer_views]
    targets = [9, 8, 7, 6, 5]
    errors = codec.decode_blocks(buf, dst, targets, namespace=NS.digest, keys=keys)
    assert [type(e) for e in errors] == WANT
    assert len(seams.native) == 1
    assert seams.python == 2  # only the records the helper refused with a header status, to name the error
    assert [n for n, _ in seams.scatters] == [2]  # the two good records, one copy
    assert _same(dst, 9, src, 0) and _same(dst, 6, src, 3)
    for t in (8, 7, 5):
        assert all(torch.equal(dst.layer_views[j][t], before[j][t]) for j in range(3)), t


def test_without_the_helper_the_python_path_gives_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Seams(monkeypatch)
    monkeypatch.setattr(fast, "AVAILABLE", False)  # as when the extension was not built
    assert not codec.verify_is_compiled(_layout(0))
    src, buf, keys = _corrupt_chunk()
    dst = _as_cuda(_layout(6))
    before = [v.clone() for v in dst.layer_views]
    errors = codec.decode_blocks(buf, dst, [9, 8, 7, 6, 5], namespace=NS.digest, keys=keys)
    assert [type(e) for e in errors] == WANT
    assert s.native == [] and s.python == 5 and [n for n, _ in s.scatters] == [2]
    assert _same(dst, 9, src, 0) and _same(dst, 6, src, 3)
    assert all(torch.equal(dst.layer_views[j][8], before[j][8]) for j in range(3))


@pytest.mark.parametrize("native", [True, False])
def test_a_store_load_spreads_a_cuda_chunks_verify_over_the_decode_threads(
        native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not fast.AVAILABLE:
        pytest.skip(f"compiled codec helper not built: {fast.UNAVAILABLE_REASON}")
    s = Seams(monkeypatch)
    if not native:
        monkeypatch.setattr(fast, "AVAILABLE", False)
    monkeypatch.setattr(fo, "WAYS", 2)
    monkeypatch.setattr(fo, "MIN_BYTES_PER_WAY", 1)  # tiny test records: every chunk worth two threads
    pool = StagingPool(8 * REC, 6, pin=False)
    store, src, keys = _filled([PieceTier("ssd", 64 * REC)], pool, 12, load_chunk_bytes=6 * REC,
                               load_first_chunk_bytes=6 * REC)
    try:
        with store:
            dst = _as_cuda(make_layout(64))
            res = store.load(dst, list(range(30, 42)), keys, timeout=10)
            assert res.loaded_block_ids == list(range(30, 42))
            for b, d in zip(range(1, 13), range(30, 42), strict=True):
                assert block_bytes(src, b) == block_bytes(dst, d)
    finally:
        pool.close()
    caller = threading.current_thread().name
    assert res.stages.chunks == 2
    assert [n for n, _ in s.scatters] == [6, 6] and {t for _, t in s.scatters} == {caller}  # one copy a chunk
    if native:  # each chunk: two ranges, one on a decode helper, each one call
        assert sorted(n for n, _ in s.native) == [3, 3, 3, 3] and s.python == 0
        assert any(t.startswith("dtkv-decode") for _, t in s.native)
    else:  # the Python verify holds the GIL: it stays on the loading thread
        assert s.native == [] and s.python == 12
