"""The CUDA save/restore ordering (``device_order``), checked against a recording stand-in of the
stream/event API: every launch, wait, record and host synchronize becomes a node of a
happens-before graph, and the tests ask the graph what the hardware would guarantee.

The same stand-in drives ``device_copy`` over CPU tensors, so the bytes and the order are checked
by one run of the code the GPU runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dynamo_tiered_kv.staging.device_copy import queue_save, restore_records
from dynamo_tiered_kv.staging.device_order import order_restore, order_save


class _Graph:
    def __init__(self) -> None:
        self.deps: list[set[int]] = []
        self.names: dict[str, int] = {}

    def node(self, deps: set[int | None], name: str | None = None) -> int:
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
        assert ev.at is not None or ev.recorded, "waiting on an event that was never recorded"
        self.run(None, ev.at)


class _Event:
    def __init__(self, host: _Stream) -> None:
        self.host, self.at, self.recorded = host, None, False

    def record(self, stream: _Stream) -> None:
        self.at, self.recorded = stream.last, True

    def synchronize(self) -> None:
        assert self.recorded, "synchronizing an event that was never recorded"
        self.host.run(None, self.at)


class RecordingOps:
    """``device_order.Ops`` that records; ``launch`` is what a kernel or copy does."""

    def __init__(self) -> None:
        self.g = _Graph()
        self.host = _Stream(self.g, "host")
        self.engine = _Stream(self.g, "engine")
        self.current = self.engine

    def current_stream(self, device: Any) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: _Stream) -> Iterator[None]:
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def event(self) -> _Event:
        return _Event(self.host)

    def launch(self, name: str) -> None:
        self.current.run(name)

    def on_host(self, name: str) -> None:
        self.host.run(name)


def test_save_gathers_after_the_forward_and_later_kernels_wait_for_the_gather_only() -> None:
    ops = RecordingOps()
    side = _Stream(ops.g, "side")
    ops.launch("forward")
    copied = order_save(ops, "dev", side, upload_ids=lambda: ops.launch("ids"),
                        gather=lambda: ops.launch("gather"), download=lambda: ops.launch("download"))
    ops.launch("next forward")  # may overwrite the saved blocks
    copied.synchronize()
    ops.on_host("checksum")
    g = ops.g
    assert g.before("forward", "gather")
    assert g.before("ids", "gather")
    assert g.before("gather", "next forward")
    assert g.before("gather", "download")
    assert g.before("download", "checksum")
    assert not g.before("download", "next forward")  # the engine never waits for the D2H copy
    assert not g.before("forward", "ids")  # the id upload overlaps the forward


def test_restore_scatters_after_queued_engine_work_and_the_host_waits_before_reusing_the_chunk() -> None:
    ops = RecordingOps()
    restore = _Stream(ops.g, "restore")
    ops.launch("kernel reading the old blocks")
    done = order_restore(ops, "dev", restore, upload=lambda: ops.launch("upload"),
                         scatter=lambda: ops.launch("scatter"))
    done.synchronize()
    ops.on_host("reuse chunk")
    g = ops.g
    assert g.before("kernel reading the old blocks", "scatter")
    assert g.before("upload", "scatter")
    assert g.before("scatter", "reuse chunk")
    assert g.before("upload", "reuse chunk")


def _engine(num_blocks: int = 12, layers: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, num_blocks, 4, 2, 16), dtype=torch.uint8, generator=g) for _ in range(layers)]


def _views(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.reshape(2, t.shape[1], -1).transpose(0, 1) for t in ts]  # [block][K/V][bytes], as layout builds


def test_queue_save_moves_the_bytes_in_the_recorded_order() -> None:
    ts = _engine()
    views = _views(ts)
    lb, hb = views[0].shape[1] * views[0].shape[2], 4096
    rb = hb + 8192
    ids = [7, 1, 10]
    dst = torch.zeros(len(ids) * rb, dtype=torch.uint8)
    ops = RecordingOps()
    side = _Stream(ops.g, "side")
    ops.launch("forward")
    forward = ops.engine.last
    ev = queue_save(views, torch.device("cpu"), ids, dst, record_bytes=rb, header_bytes=hb, layer_bytes=lb,
                    ops=ops, side=side)
    ev.synchronize()
    recs = dst.view(len(ids), rb)
    for i, b in enumerate(ids):
        want = torch.cat([v[b].reshape(-1) for v in views])
        assert torch.equal(recs[i, hb:hb + len(views) * lb], want)
    assert ev.recorded and side.last is not None  # the copies went through the side stream
    assert ops.engine.last != forward  # and the engine's stream waits on it


def test_restore_records_scatters_packed_and_chunked_records() -> None:
    ts = _engine(seed=1)
    views = _views(ts)
    lb, hb = views[0].shape[1] * views[0].shape[2], 4096
    rb = hb + 8192
    rng = np.random.default_rng(5)
    recs = [rng.integers(0, 256, rb, dtype=np.uint8) for _ in range(3)]
    ids = [2, 9, 4]
    ops = RecordingOps()
    restore_records(recs, views, torch.device("cpu"), ids, record_bytes=rb, header_bytes=hb, layer_bytes=lb,
                    ops=ops, stream=_Stream(ops.g, "r"))
    for r, b in zip(recs, ids):
        assert torch.equal(torch.cat([v[b].reshape(-1) for v in views]), torch.from_numpy(r[hb:hb + 3 * lb]))
    chunk = np.concatenate(recs[::-1])
    restore_records([], views, torch.device("cpu"), [5, 6, 0], record_bytes=rb, header_bytes=hb, layer_bytes=lb,
                    chunk=chunk, ops=ops, stream=_Stream(ops.g, "r"))
    for r, b in zip(recs[::-1], [5, 6, 0]):
        assert torch.equal(torch.cat([v[b].reshape(-1) for v in views]), torch.from_numpy(r[hb:hb + 3 * lb]))
