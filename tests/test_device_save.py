"""A GPU-direct save (records built in a device slab for GDS) never blocks the engine thread: the
engine thread only queues the gather, ordered after the forward that wrote the blocks; the
checksums, their copy to the host, the headers and the tier write happen on the store's writer.

Checked without a GPU: a recording stand-in of the stream/event API (``device_order.Ops``) turns
every launch, wait, record and host synchronize into a node of a happens-before graph, over the
same code the GPU runs on CPU tensors; and at the store level, every host-blocking call (event or
device synchronize, a device-to-host ``.cpu()``, a blocking ``copy_``) is recorded with its thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dynamo_tiered_kv import kernels
from dynamo_tiered_kv.blocks import codec, device_codec
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.staging import device_slabs

NS3 = Namespace("m", "bf16", "KV_SPLIT", 16, 3, 2, 64)
IDS = [7, 0, 3, 8, 5]


# --- a recording stand-in of streams and events -------------------------------------------------
class _Graph:
    def __init__(self) -> None:
        self.deps: list[set[int]] = []
        self.names: dict[str, int] = {}
        self.lock = threading.Lock()

    def node(self, deps: set[int | None], name: str | None = None) -> int:
        with self.lock:
            self.deps.append({d for d in deps if d is not None})
            i = len(self.deps) - 1
            if name is not None:
                assert name not in self.names, f"{name} launched twice"
                self.names[name] = i
            return i

    def before(self, a: str, b: str) -> bool:
        """Is ``a`` guaranteed complete before ``b`` starts?"""
        src, seen, todo = self.names[a], set(), [self.names[b]]
        while todo:
            i = todo.pop()
            if i == src:
                return True
            if i not in seen:
                seen.add(i)
                todo.extend(self.deps[i])
        return False


class _Stream:
    def __init__(self, g: _Graph, name: str) -> None:
        self.g, self.name, self.last = g, name, None

    def run(self, name: str | None = None, *extra: int | None) -> int:
        self.last = self.g.node({self.last, *extra}, name)
        return self.last

    def wait_event(self, ev: _Event) -> None:
        assert ev.recorded, "waiting on an event that was never recorded"
        self.run(None, ev.at)


class _Event:
    def __init__(self, ops: RecordingOps) -> None:
        self.ops, self.at, self.recorded = ops, None, False

    def record(self, stream: _Stream) -> None:
        self.at, self.recorded = stream.last, True

    def synchronize(self) -> None:
        assert self.recorded, "synchronizing an event that was never recorded"
        self.ops.syncs.append(threading.get_ident())
        self.ops.host.run(None, self.at)


class RecordingOps:
    """``device_order.Ops`` that records; ``launch`` is what a kernel or copy does."""

    def __init__(self) -> None:
        self.g = _Graph()
        self.host = _Stream(self.g, "host")
        self.engine = _Stream(self.g, "engine")
        self._local = threading.local()
        self.syncs: list[int] = []  # threads that blocked on an event

    @property
    def current(self) -> _Stream:
        return getattr(self._local, "current", self.engine)

    def current_stream(self, device: Any) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: _Stream) -> Iterator[None]:
        prev, self._local.current = self.current, stream
        try:
            yield
        finally:
            self._local.current = prev

    def event(self) -> _Event:
        return _Event(self)

    def launch(self, name: str) -> None:
        self.current.run(name)

    def on_host(self, name: str) -> None:
        self.host.run(name)


def _engine(kind: EngineLayoutKind = EngineLayoutKind.FLASH_ATTN, seed: int = 1) -> EngineLayout:
    heads = 1 if kind is EngineLayoutKind.MLA else 2
    ts = allocate_engine_kv(kind, num_layers=3, num_blocks=9, block_size=16, num_kv_heads=heads, head_size=64)
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return EngineLayout(kind, ts, 16, heads, 64)


def _named(monkeypatch: pytest.MonkeyPatch, ops: RecordingOps) -> None:
    """Name the gather, the checksums and the header build in the graph (the real work still runs)."""
    gather, sums, header = kernels.gather_records, device_codec._layer_sums_on_device, device_codec._write_header
    built: list[int] = []

    def named_gather(*a: Any, **kw: Any) -> None:
        ops.launch("gather")
        gather(*a, **kw)

    def named_sums(*a: Any, **kw: Any) -> torch.Tensor:
        ops.launch("checksum")
        return sums(*a, **kw)

    def named_header(*a: Any, **kw: Any) -> None:
        if not built:
            ops.on_host("headers")
        built.append(1)
        header(*a, **kw)

    monkeypatch.setattr(kernels, "gather_records", named_gather)
    monkeypatch.setattr(device_codec, "_layer_sums_on_device", named_sums)
    monkeypatch.setattr(device_codec, "_write_header", named_header)


@pytest.mark.parametrize("kind", [EngineLayoutKind.FLASH_ATTN, EngineLayoutKind.MLA], ids=["flash_attn", "mla"])
def test_engine_thread_only_queues_the_gather_and_the_writer_completes_the_records(
        kind: EngineLayoutKind, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = RecordingOps()
    _named(monkeypatch, ops)
    lay = _engine(kind)
    keys = chain_keys(NS3, range(16 * len(IDS)))
    parents = parents_of(keys)
    rb = codec.record_bytes(lay.shape)
    out = torch.full((rb * len(IDS),), 0xEE, dtype=torch.uint8)
    save, writer = _Stream(ops.g, "save"), _Stream(ops.g, "writer")

    ops.launch("forward")  # wrote the blocks
    seal = device_codec.begin_encode_on_device(lay, IDS, [NS3.digest] * len(IDS), keys, parents, out, ops=ops,
                                               save=save, writer=writer)
    assert ops.syncs == [], "the engine thread waited for the device"
    assert "checksum" not in ops.g.names and "headers" not in ops.g.names  # the writer's part
    ops.launch("next forward")  # may overwrite the saved blocks

    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(seal()))
    t.start()
    t.join(30)
    assert done == [rb * len(IDS)]
    ops.on_host("tier write")  # what the store does once the seal returned

    g = ops.g
    assert g.before("forward", "gather")
    assert g.before("gather", "next forward")  # a reused block is overwritten only after the gather
    assert not g.before("checksum", "next forward")  # the engine never waits for the checksums
    assert g.before("gather", "checksum")
    assert g.before("checksum", "headers")  # the headers need the sums on the host
    assert g.before("headers", "tier write") and g.before("checksum", "tier write")
    assert ops.syncs and threading.get_ident() not in ops.syncs  # only the writer thread blocked

    ref = np.zeros(rb * len(IDS), np.uint8)
    codec.encode_blocks(lay, IDS, [NS3.digest] * len(IDS), keys, parents, ref)
    assert np.array_equal(out.numpy(), ref), "the records differ from the host codec's"


def test_a_failing_second_half_waits_for_the_queued_work_before_it_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = RecordingOps()
    _named(monkeypatch, ops)

    def failing(*a: Any, **kw: Any) -> None:
        raise RuntimeError("header build failed")

    monkeypatch.setattr(device_codec, "_write_header", failing)
    lay = _engine()
    keys = chain_keys(NS3, range(16 * 2))
    rb = codec.record_bytes(lay.shape)
    out = torch.zeros(2 * rb, dtype=torch.uint8)
    save, writer = _Stream(ops.g, "save"), _Stream(ops.g, "writer")
    seal = device_codec.begin_encode_on_device(lay, [1, 2], [NS3.digest] * 2, keys, parents_of(keys), out, ops=ops,
                                               save=save, writer=writer)
    with pytest.raises(RuntimeError, match="header build failed"):
        seal()
    ops.on_host("slab freed")
    assert ops.g.before("gather", "slab freed") and ops.g.before("checksum", "slab freed")


def test_bad_arguments_raise_on_the_calling_thread_and_queue_nothing() -> None:
    ops = RecordingOps()
    lay = _engine()
    keys = chain_keys(NS3, range(16))
    rb = codec.record_bytes(lay.shape)
    with pytest.raises(IndexError):
        device_codec.begin_encode_on_device(lay, [9], [NS3.digest], keys, parents_of(keys),
                                            torch.zeros(rb, dtype=torch.uint8), ops=ops)
    with pytest.raises(ValueError):
        device_codec.begin_encode_on_device(lay, [0], [NS3.digest], keys, parents_of(keys),
                                            torch.zeros(rb - 1, dtype=torch.uint8), ops=ops)
    assert ops.g.deps == []


# --- the store: a GPU-direct offload, with every host-blocking call recorded by thread ------------
class _Blocking:
    """Records (thread, what) for every call that makes the host wait for a device."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def note(self, what: str) -> None:
        self.calls.append((threading.get_ident(), what))

    def on(self, thread: int) -> list[str]:
        return [w for t, w in self.calls if t == thread]


class _CountingOps:
    """Streams and events over CPU tensors (work runs at once) whose waits are recorded."""

    def __init__(self, blocking: _Blocking) -> None:
        self.blocking = blocking

    def current_stream(self, device: Any) -> Any:
        return self

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self) -> Any:
        return self

    def wait_event(self, event: Any) -> None:  # a device-side wait: the host goes on
        pass

    def record(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        self.blocking.note("event.synchronize")


def _record_blocking(monkeypatch: pytest.MonkeyPatch) -> _Blocking:
    blocking = _Blocking()

    def wrap(owner: Any, name: str, what: Callable[..., str | None]) -> None:
        real = getattr(owner, name)

        def recorded(*a: Any, **kw: Any) -> Any:
            w = what(*a, **kw)
            if w:
                blocking.note(w)
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, recorded)

    wrap(device_slabs, "synchronize", lambda *a, **kw: "device synchronize")
    wrap(device_codec, "synchronize", lambda *a, **kw: "device synchronize")
    wrap(torch.cuda, "synchronize", lambda *a, **kw: "torch.cuda.synchronize")
    wrap(torch.Tensor, "cpu", lambda *a, **kw: "device-to-host .cpu()")
    wrap(torch.Tensor, "copy_", lambda self, src, non_blocking=False: None if non_blocking else "blocking copy_")
    try:
        from dynamo_tiered_kv.staging import device_save
    except ImportError:  # nothing to hand the recording ops to
        pass
    else:
        monkeypatch.setattr(device_save, "ops_for", lambda device: _CountingOps(blocking))
    return blocking


def test_store_gpu_direct_offload_never_blocks_the_engine_thread(tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nixl")
    from test_store_gpu_direct import KEYS, N, Rig, block, layout

    rig = Rig(tmp_path)
    try:
        src, dst = layout(1), layout(2)
        with rig.store() as s:
            blocking = _record_blocking(monkeypatch)
            assert s.submit_offload(src, list(range(N)), KEYS, parents_of(KEYS))
            on_engine = blocking.on(threading.get_ident())
            assert s.drain(10)
            monkeypatch.undo()
            assert on_engine == [], f"the engine thread blocked: {on_engine}"
            writer = [w for t, w in blocking.calls if t != threading.get_ident()]
            assert "event.synchronize" in writer  # the writer waited for the device work instead
            targets = [N + 3 - i for i in range(N)]
            res = s.load(dst, targets, KEYS)
            assert res.loaded_block_ids == targets and not res.failed_block_ids
            assert all(block(src, i) == block(dst, t) for i, t in enumerate(targets))
        assert rig.pool.free_count == 2
    finally:
        rig.close()


@pytest.mark.gpu
def test_cuda_gpu_direct_save_returns_with_a_forward_queued_and_gathers_before_later_kernels() -> None:
    """On a GPU: with about a second of "forward" queued on the engine's stream, the engine thread's
    half returns before the forward ends and makes no synchronizing CUDA call (PyTorch's sync debug
    mode raises on one); a kernel queued after it that overwrites the saved blocks does not reach
    the records; the writer's half leaves records equal to the host codec's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kind = EngineLayoutKind.FLASH_ATTN
    ts = allocate_engine_kv(kind, num_layers=4, num_blocks=32, block_size=16, num_kv_heads=8, head_size=128,
                            dtype=torch.bfloat16, device="cuda")
    lay = EngineLayout(kind, ts, 16, 8, 128)
    for t in ts:
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    ids = [3, 9, 17, 30]
    keys = chain_keys(NS3, range(16 * len(ids)))
    parents = parents_of(keys)
    ns = [NS3.digest] * len(ids)
    rb = codec.record_bytes(lay.shape)
    out = torch.empty(len(ids) * rb, dtype=torch.uint8, device="cuda")
    device_codec.warm_up_device_kernels(lay)
    device_codec.encode_blocks_on_device(lay, ids, ns, keys, parents, out)  # streams, pinned pool: warm
    torch.cuda.synchronize()
    want = [t.cpu() for t in ts]

    torch.cuda._sleep(2_000_000_000)  # "the forward": about a second of GPU time on the engine's stream
    forward = torch.cuda.Event()
    forward.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        seal = device_codec.begin_encode_on_device(lay, ids, ns, keys, parents, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    queued = not forward.query()
    idx = torch.tensor(ids, device="cuda")
    for t in ts:  # a later request reuses the blocks (FLASH_ATTN: blocks on dim 1)
        t.index_fill_(1, idx, 0)
    assert queued, "the engine thread's half waited for the forward"

    done: list[int] = []
    writer = threading.Thread(target=lambda: done.append(seal()))
    writer.start()
    writer.join(120)
    assert done == [len(ids) * rb]
    ref = np.zeros(len(ids) * rb, np.uint8)
    codec.encode_blocks(EngineLayout(kind, want, 16, 8, 128), ids, ns, keys, parents, ref)
    assert np.array_equal(out.cpu().numpy(), ref), "the records differ from the host codec's"
