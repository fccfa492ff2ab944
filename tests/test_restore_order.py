"""The ordering of a CUDA load's restore chunks, checked with a recording stand-in of the
stream/event API (``test_device_order``'s happens-before graph) on CPU tensors: the same code the
GPU runs, through the store's read pipeline, the record codec and the device codec.

What a load must do on a busy engine: take the engine's point once (the kernels queued when the
load started may still read its blocks), order every chunk's scatter after that point only, never
after a forward the engine queued while the load ran, keep the host verifying the next chunk while
the previous one's copy runs, and wait on the device only to reuse a buffer or to finish.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_device_copy import _as_cuda
from test_device_order import RecordingOps, _Event, _Stream

from dynamo_tiered_kv import kernels
from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.device_codec import decode_blocks_on_device
from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.errors import ChecksumMismatch
from dynamo_tiered_kv.staging import device_copy
from dynamo_tiered_kv.staging.device_order import RestoreOrder, mark_engine
from dynamo_tiered_kv.staging.slabs import StagingPool
from tests.test_store import REC, block_bytes, make_layout
from tests.test_store_pipeline import PieceTier, _filled


class _CountedEvent(_Event):
    def __init__(self, ops: CountingOps) -> None:
        super().__init__(ops.host)
        self.ops = ops

    def record(self, stream: _Stream) -> None:
        super().record(stream)
        self.ops.recorded.append(stream.name)

    def synchronize(self) -> None:
        self.ops.syncs += 1
        super().synchronize()

    def query(self) -> bool:
        """``keeps_up``: the device finished the work before the host asks (the host then knows
        it is done, as after a wait); else nothing is known to be done without a wait."""
        if self.ops.keeps_up:
            self.host.run(None, self.at)
        return self.ops.keeps_up


class CountingOps(RecordingOps):
    """Counts host waits and the streams events are recorded on; tracks the device guard."""

    def __init__(self, keeps_up: bool = False) -> None:
        super().__init__()
        self.keeps_up = keeps_up
        self.syncs = 0
        self.recorded: list[str] = []
        self.guarded: Any = None  # the device the current device guard names

    def event(self) -> _CountedEvent:
        return _CountedEvent(self)

    def guard(self, device: Any) -> Any:
        ops = self

        class _Guard:
            def __enter__(self) -> None:
                self.prev, ops.guarded = ops.guarded, device

            def __exit__(self, *exc: object) -> None:
                ops.guarded = self.prev

        return _Guard()


def test_every_chunk_waits_for_the_one_mark_not_for_forwards_queued_later() -> None:
    ops = CountingOps()
    ops.launch("forward 0")  # may still read the blocks the load gets
    mark = mark_engine(ops, "dev")
    restore = _Stream(ops.g, "restore")
    order = RestoreOrder(ops, "dev", restore, mark, depth=8)
    for k in range(4):
        ops.engine.run(f"forward {k + 1}")  # the engine queues its next forward while the load runs
        order.queue(upload=lambda k=k: ops.launch(f"upload {k}"), scatter=lambda k=k: ops.launch(f"scatter {k}"))
    order.finish()
    ops.on_host("report")
    g = ops.g
    assert ops.recorded.count("engine") == 1
    for k in range(4):
        assert g.before("forward 0", f"scatter {k}") and g.before(f"scatter {k}", "report")
        assert not any(g.before(f"forward {j}", f"scatter {k}") for j in range(1, 5))
    assert ops.syncs == 1  # depth 8: no wait until the end, one for all four chunks


def test_a_buffer_is_rewritten_only_after_the_copy_that_reads_it_and_depth_bounds_the_chunks_in_flight() -> None:
    ops = CountingOps()
    order = RestoreOrder(ops, "dev", _Stream(ops.g, "restore"), depth=2)
    released: list[int] = []
    buffers = ("buffer A", "buffer B")  # two host buffers, taken in turn (named by identity)
    for k in range(5):
        order.reuse(buffers[k % 2])
        ops.on_host(f"pack {k}")
        order.queue(upload=lambda k=k: ops.launch(f"upload {k}"), scatter=lambda k=k: ops.launch(f"scatter {k}"),
                    reads=buffers[k % 2])
        order.after(lambda k=k: released.append(k))
        assert order.in_flight() <= 2
    g = ops.g
    for k in range(2, 5):
        assert g.before(f"upload {k - 2}", f"pack {k}")  # buffer k % 2 again: its last copy is done
    assert not g.before("upload 3", "pack 4")  # the other buffer's copy still runs while this one is packed
    assert released == [0, 1, 2]  # each release once its chunk is known done
    order.finish()
    assert released == [0, 1, 2, 3, 4] and ops.syncs == 4  # three reuses and the end: not one per chunk


def _fake_cuda_load(monkeypatch: pytest.MonkeyPatch, ops: CountingOps) -> tuple[list[str], Callable[[], None]]:
    """Route the store's CUDA restores through ``ops``: one restore stream, scatters and host
    verifies recorded, and the engine queuing a forward after every scatter. Returns the names of
    the verify nodes and a function that queues the next forward (``forward 1``, ``2``, ...) on the
    engine stream."""
    restore = _Stream(ops.g, "restore")
    monkeypatch.setattr(device_copy, "_ops_for", lambda device: ops)
    monkeypatch.setattr(device_copy, "_restore_stream", lambda device: restore)
    monkeypatch.setattr(device_copy, "_device_ctx", ops.guard)
    chunk, forwards = [0], [0]
    verifies: list[str] = []
    real_scatter, real_verify = kernels.scatter_records, codec.verify_for_device

    def forward() -> None:
        forwards[0] += 1
        ops.engine.run(f"forward {forwards[0]}")

    def scatter(*a: Any, **kw: Any) -> None:
        assert ops.current is restore and ops.guarded is not None
        ops.launch(f"scatter {chunk[0]}")
        real_scatter(*a, **kw)
        chunk[0] += 1
        forward()  # the engine goes on: its next forward is queued while the load runs

    def verify(*a: Any, **kw: Any) -> Any:
        name = f"verify {chunk[0]} {len(verifies)}"
        verifies.append(name)
        ops.on_host(name)
        return real_verify(*a, **kw)

    monkeypatch.setattr(kernels, "scatter_records", scatter)
    monkeypatch.setattr(codec, "verify_for_device", verify)
    return verifies, forward


@pytest.mark.parametrize("keeps_up", [True, False])
def test_a_store_load_of_several_chunks_marks_the_engine_once_and_overlaps_verify_with_the_copies(
        monkeypatch: pytest.MonkeyPatch, keeps_up: bool) -> None:
    ops = CountingOps(keeps_up)
    verifies, _ = _fake_cuda_load(monkeypatch, ops)
    pool = StagingPool(8 * REC, 6, pin=False)
    store, src, keys = _filled([PieceTier("ssd", 64 * REC)], pool, 12, load_chunk_bytes=2 * REC,
                               load_first_chunk_bytes=2 * REC)
    try:
        with store:
            dst = _as_cuda(make_layout(64))
            ops.launch("forward 0")  # queued before the load: may still read the blocks the load gets
            res = store.load(dst, list(range(30, 42)), keys, timeout=10)
            ops.on_host("report")
            assert res.loaded_block_ids == list(range(30, 42))
            for s, d in zip(range(1, 13), range(30, 42), strict=True):
                assert block_bytes(src, s) == block_bytes(dst, d)
            assert pool.free_count == 6  # every slab back once the load returned
    finally:
        pool.close()
    n = res.stages.chunks
    assert n == 6  # 2 blocks each
    g = ops.g
    assert ops.recorded.count("engine") == 1  # one mark for the whole load, not one per chunk
    for k in range(n):
        assert g.before("forward 0", f"scatter {k}") and g.before(f"scatter {k}", "report")
        assert not any(g.before(f"forward {j}", f"scatter {k}") for j in range(1, n + 1)), k
    for k in range(1, n):  # the host verified chunk k while chunk k-1's copy and scatter could run
        first = next(v for v in verifies if v.startswith(f"verify {k} "))
        assert not g.before(f"scatter {k - 1}", first), first
    # a device that keeps up: one wait, at the end; a slow one: a wait only past two chunks in flight
    assert ops.syncs == (1 if keeps_up else n - 1)


def test_the_connector_marks_the_engine_when_it_starts_the_load_and_the_restore_thread_orders_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv.config import TieredKVConfig
    from dynamo_tiered_kv.connectors.vllm.metadata import LoadSpec, TieredKVMetadata
    from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole
    from dynamo_tiered_kv.store.store import LoadResult

    ops = CountingOps()
    monkeypatch.setattr(device_copy, "cuda_ops", lambda: ops)
    _, forward = _fake_cuda_load(monkeypatch, ops)
    gate, cpu = threading.Event(), torch.device("cpu")
    shape = make_layout(1).shape
    views = _as_cuda(make_layout(8, seed=3)).layer_views

    class Store:
        """Loads on the onboarding thread: two chunks, each a one-record restore, as the pipeline does."""

        def load(self, layout: Any, ids: list[int], keys: Any, timeout: float = 0, pacer: Any = None) -> LoadResult:
            assert gate.wait(5)
            with device_copy.RestoreSession(cpu) as s:
                for i, b in enumerate(ids):
                    device_copy.restore_records([np.zeros(REC, np.uint8)], views, cpu, [b], record_bytes=REC,
                                                header_bytes=codec.header_bytes(shape.num_layers),
                                                layer_bytes=shape.layer_bytes, session=s)
                    if i == 0:
                        forward()  # another engine step meanwhile
            return LoadResult(list(ids), [], ["ssd"] * len(ids))

        def close(self) -> None:
            pass

    w = WorkerRole(TieredKVConfig.from_mapping({}), model_id="m", kv_dtype="bf16", block_size=16, num_kv_heads=1,
                   head_size=1, tp_rank=0, tp_size=1, engine_key="x", authkey=b"x")
    from dynamo_tiered_kv.blocks.keys import Namespace

    w.store, w.layout = Store(), SimpleNamespace(is_cuda=True, device=cpu)  # type: ignore[assignment]
    w.namespace = Namespace("m", "bf16", "FLASH_ATTN", 16, 1, 1, 1)
    ops.launch("forward 0")
    w.start_load_kv(TieredKVMetadata(loads=[LoadSpec("r", [1, 2], [b"a" * 16, b"b" * 16], is_async=True)]))
    assert ops.recorded == ["engine"]  # recorded on the engine thread, when the load started
    forward()  # the engine's forward of this step, queued before the restore thread even starts
    gate.set()
    done: set[str] = set()
    for _ in range(500):
        done |= w.get_finished(set())
        if done:
            break
        threading.Event().wait(0.01)
    w.shutdown()
    assert done == {"r"}
    g = ops.g
    assert ops.recorded.count("engine") == 1
    for k in range(2):
        assert g.before("forward 0", f"scatter {k}")
        assert not any(g.before(f"forward {j}", f"scatter {k}") for j in range(1, 5)), k


def test_device_decode_runs_under_the_records_device_on_the_restore_stream_with_one_wait_per_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ops = CountingOps()
    restore = _Stream(ops.g, "restore")
    monkeypatch.setattr(device_copy, "_device_ctx", ops.guard)
    src, dst = make_layout(8, seed=4), make_layout(8, seed=5)
    keys = [bytes([i]) * 16 for i in range(4)]
    rb = codec.record_bytes(src.shape)
    buf = np.zeros(4 * rb, np.uint8)
    codec.encode_blocks(src, [1, 2, 3, 4], [codec_ns()] * 4, keys, parents_of(keys), buf)
    buf[3 * rb + codec.header_bytes(2) + 5] ^= 1  # the last record of the second chunk is corrupt
    records = torch.from_numpy(buf)
    launched: list[tuple[str, Any, Any]] = []
    real_sums, real_scatter = kernels.xxh3_64_rows, kernels.scatter_records

    def sums(rows: torch.Tensor) -> torch.Tensor:
        launched.append(("sums", ops.current, ops.guarded))
        ops.launch(f"sums {len(launched)}")
        return real_sums(rows)

    def scatter(*a: Any, **kw: Any) -> None:
        launched.append(("scatter", ops.current, ops.guarded))
        ops.launch(f"scatter {len(launched)}")
        real_scatter(*a, **kw)

    monkeypatch.setattr(kernels, "xxh3_64_rows", sums)
    monkeypatch.setattr(kernels, "scatter_records", scatter)
    ops.launch("forward 0")
    session = device_copy.RestoreSession(records.device, ops=ops, stream=restore)
    before = ops.syncs
    assert decode_blocks_on_device(records[:2 * rb], dst, [5, 6], namespace=codec_ns(), keys=keys[:2],
                                   session=session) == [None, None]
    assert ops.syncs - before == 1
    ops.engine.run("forward 1")
    errs = decode_blocks_on_device(records[2 * rb:], dst, [7, 0], namespace=codec_ns(), keys=keys[2:],
                                   session=session)
    assert errs[0] is None and isinstance(errs[1], ChecksumMismatch)
    assert ops.syncs - before == 2  # one wait per chunk (the checksums and headers to the host)
    assert session.finish()
    ops.on_host("report")
    assert [k for k, _, _ in launched] == ["sums", "scatter", "sums", "scatter"]
    assert all(stream is restore and dev == records.device for _, stream, dev in launched)
    g = ops.g
    assert g.before("forward 0", "scatter 2") and g.before("forward 0", "scatter 4")
    assert not g.before("forward 1", "scatter 4")  # the second chunk does not wait for a later forward
    assert g.before("scatter 4", "report")
    for s, d in zip([1, 2, 3], [5, 6, 7], strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    assert block_bytes(dst, 0) == block_bytes(make_layout(8, seed=5), 0)  # the corrupt record never landed


def codec_ns() -> bytes:
    from tests.test_store import NS

    return NS.digest


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["host slab", "device records"])
def test_on_cuda_a_restore_does_not_wait_for_a_forward_queued_after_its_mark(path: str) -> None:
    """The real streams: a long kernel on the engine's stream after the mark (a forward of a later
    step) is still running when the restore is done; a restore marked after it (the negative
    control, as each chunk did when it took its own mark) waits for it."""
    from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
    from tests.test_store import NS

    dev = torch.device("cuda", torch.cuda.current_device())
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=4, num_blocks=32, block_size=16,
                            num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device=dev)
    layout = EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 16, 8, 128)
    cpu = EngineLayout(EngineLayoutKind.FLASH_ATTN, [torch.randn(t.shape).to(t.dtype) for t in ts], 16, 8, 128)
    keys = [bytes([i]) * 16 for i in range(8)]
    rb = codec.record_bytes(layout.shape)
    slab = torch.empty(8 * rb, dtype=torch.uint8).pin_memory()
    codec.encode_blocks(cpu, list(range(8)), [NS.digest] * 8, keys, parents_of(keys), slab.numpy())
    on_device = slab.to(dev)

    def restore(session: device_copy.RestoreSession, targets: list[int]) -> None:
        for a in (0, 4):  # two chunks
            if path == "host slab":
                errs = codec.decode_blocks(slab.numpy()[a * rb:(a + 4) * rb], layout, targets[a:a + 4],
                                           namespace=NS.digest, keys=keys[a:a + 4], session=session)
            else:
                errs = decode_blocks_on_device(on_device[a * rb:(a + 4) * rb], layout, targets[a:a + 4],
                                               namespace=NS.digest, keys=keys[a:a + 4], session=session)
            assert errs == [None] * 4

    with device_copy.RestoreSession(dev) as warm:  # compiles the kernels: the host's time is not the test's
        restore(warm, list(range(8, 16)))
    torch.cuda.synchronize()
    mark = device_copy.engine_mark(dev)
    torch.cuda._sleep(1_000_000_000)  # about half a second of a later forward on the engine's stream
    forward = torch.cuda.Event()
    forward.record()
    with device_copy.restore_after(mark), device_copy.RestoreSession(dev) as s:
        restore(s, list(range(16, 24)))
    assert not forward.query(), "the restore waited for a forward queued after its mark"
    torch.cuda.synchronize()
    for i in range(8):
        for c, t in zip(cpu.tensors, ts):
            assert torch.equal(t[:, 16 + i].cpu(), c[:, i])
    torch.cuda._sleep(1_000_000_000)
    forward.record()
    with device_copy.RestoreSession(dev) as late:  # marked after the long kernel: must wait for it
        restore(late, list(range(24, 32)))
    assert forward.query(), "the negative control did not wait: this check cannot see the difference"
