"""The batched copies between a CUDA engine's KV blocks and host record buffers, in the order
``device_order`` prescribes.

Save: engine blocks -> one contiguous device buffer (one gather launch) -> one copy into the host
slab. Restore: one contiguous copy of a chunk of verified records to the device -> one scatter
launch. Either way one copy per batch, not per block or layer, and never a host-synchronous one:
block ids travel through pinned memory, copies are ``non_blocking``, and the caller waits on the
returned event (off the engine thread for saves).

Restores run on a stream of their own per restore thread and device, under that device
(``torch.cuda.device``): a tensor-parallel rank's restore thread never launches on device 0. A load
is one ``RestoreSession``: its chunks wait for one engine mark (``engine_mark``, recorded when the
engine started the load and handed to the restoring thread with ``restore_after``) and stay in
flight together; the host waits only before it reuses a buffer a copy still reads, and once when
the load ends (``device_order.RestoreOrder``).

Everything here also runs on CPU tensors (``pin`` off, a stand-in ``Ops``), which is how CI checks
the bytes and the ordering together.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .device_order import Ops, RestoreOrder, cuda_ops, inline_ops, mark_engine, order_save

log = logging.getLogger(__name__)
_side: dict[Any, Any] = {}  # one save stream per CUDA device, shared by every layout on it
_side_lock = threading.Lock()
_local = threading.local()  # per thread: {(device, role): stream}; the engine mark its load orders after
#: chunks of one load queued on the device and not yet waited for (each may hold a staging slab)
RESTORE_DEPTH = 2


def save_stream(device: torch.device) -> Any:
    """The stream saves queue their gathers on: one per CUDA device, shared by every engine thread
    and layout on it, for host-slab and GPU-direct saves alike (a CPU device's: the inline one)."""
    if device.type != "cuda":
        return inline_ops().current_stream(device)
    with _side_lock:
        s = _side.get(device)
        if s is None:
            s = _side[device] = torch.cuda.Stream(device)
        return s


def ops_for(device: torch.device) -> Ops:
    """``torch.cuda``'s streams and events for a CUDA device; the inline stand-in otherwise."""
    return cuda_ops() if device.type == "cuda" else inline_ops()


def thread_stream(device: torch.device, role: str) -> Any:
    """The calling thread's own stream on ``device`` for ``role`` ("restore", "writer"; created on
    first use), so one thread's work never queues behind another's (a CPU device's: the inline one)."""
    if device.type != "cuda":
        return inline_ops().current_stream(device)
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    s = streams.get((device, role))
    if s is None:
        s = streams[(device, role)] = torch.cuda.Stream(device)
    return s


# the names the save and restore paths look up at call time (tests put recording stand-ins there)
def _save_stream(device: torch.device) -> Any:
    return save_stream(device)


def _ops_for(device: torch.device) -> Ops:
    return ops_for(device)


def _restore_stream(device: torch.device) -> Any:
    """This thread's restore stream on ``device`` (a CPU device's: the inline one)."""
    return thread_stream(device, "restore")


def ids_on(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids on ``device`` without a host-synchronous copy: staged in pinned memory on CUDA
    (queued on the current stream)."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type != "cuda":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def _device_ctx(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def queue_save(views: Sequence[torch.Tensor], device: torch.device, block_ids: Sequence[int], dst: torch.Tensor, *,
               record_bytes: int, header_bytes: int, layer_bytes: int, ops: Ops | None = None,
               side: Any = None) -> Any:
    """Queue the payloads of ``block_ids`` into records in ``dst`` (a flat uint8 host slab); returns
    the event to synchronize before reading ``dst``. Headers and checksums are the caller's."""
    from ..kernels import gather_records

    n = len(block_ids)
    ops = ops or cuda_ops()
    side = side if side is not None else _save_stream(device)
    st: dict[str, torch.Tensor] = {}

    def upload_ids() -> None:
        st["ids"] = ids_on(block_ids, device)

    def gather() -> None:  # allocated on the side stream: the allocator reuses it only in that stream's order
        st["buf"] = torch.empty(n * record_bytes, dtype=torch.uint8, device=device)
        gather_records(views, st["ids"], st["buf"], record_bytes=record_bytes, header_bytes=header_bytes,
                       layer_bytes=layer_bytes)

    def download() -> None:
        dst[: n * record_bytes].copy_(st["buf"], non_blocking=True)

    with _device_ctx(device):
        return order_save(ops, device, side, upload_ids=upload_ids, gather=gather, download=download)


def engine_mark(device: torch.device) -> Any:
    """The engine's point for a load into ``device``: an event on the calling thread's current
    stream (``device_order.mark_engine``), for a CUDA layout. Call on the engine thread when it
    starts the load, and hand the mark to the restoring thread (``restore_after``)."""
    with _device_ctx(device):
        return mark_engine(cuda_ops(), device)


@contextlib.contextmanager
def restore_after(mark: Any) -> Iterator[None]:
    """Within it, the calling thread's restore sessions order their scatters after ``mark``
    (``engine_mark``) instead of a point of their own: a context of the thread, like
    ``torch.cuda.stream``. None: no mark (each session records one when it opens)."""
    prev = getattr(_local, "mark", None)
    _local.mark = mark
    try:
        yield
    finally:
        _local.mark = prev


# per restore thread: two pinned host buffers for records that are not back to back; one session
# at a time uses them on a thread (a load's, or a one-chunk one outside any load)
_scratch = threading.local()
_SCRATCH = ("scratch 0", "scratch 1")  # their names in a ``RestoreOrder`` (compared by identity)


def _pinned_scratch(turn: int, nbytes: int, pin: bool) -> torch.Tensor:
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = [None, None]
    buf = bufs[turn]
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if pin:
            buf = buf.pin_memory()
        bufs[turn] = buf
    return buf[:nbytes]


class RestoreSession:
    """One load's restores into ``device`` from the calling thread (module docstring).

    Chunks (``restore_records``, ``device_codec.decode_blocks_on_device``) are queued on this
    thread's restore stream after one engine mark: ``mark``, else the thread's ``restore_after``
    mark, else one recorded when the session opens. The session's owner hands it every buffer
    release that must wait for the copies (``after``), calls ``settle`` before it blocks on a
    buffer the session may hold, and ``finish`` (or leaves the ``with`` block) before it reports
    the load: then the blocks hold the records and nothing reads a host buffer any more.
    ``ops``/``stream``: the stream/event interface and restore stream (``torch.cuda``'s, this
    thread's; ``inline_ops`` for a CPU device). Thread: the calling thread only.
    """

    def __init__(self, device: torch.device, *, mark: Any = None, ops: Ops | None = None, stream: Any = None,
                 depth: int = RESTORE_DEPTH) -> None:
        self.device = device
        self.ops = ops if ops is not None else _ops_for(device)
        with self.guard():
            self.stream = stream if stream is not None else _restore_stream(device)
            mark = mark if mark is not None else getattr(_local, "mark", None)
            self.order = RestoreOrder(self.ops, device, self.stream, mark, depth=depth)
        self._turn = 0  # which of the thread's two scratch buffers the next packed chunk uses
        self._broken = False  # a wait for the device failed: no block of the load is trusted

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        """The session's device as the current one (a rank's restore thread never launches on device 0)."""
        return _device_ctx(self.device)

    def scratch(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """A pinned host buffer to pack a chunk into, no copy reading it any more, and its name for
        ``RestoreOrder.queue(reads=...)``. It alternates between two: the host waits only when the
        one it takes is still being read."""
        turn = self._turn
        self._turn ^= 1
        name = _SCRATCH[turn]
        with self._failing(), self.guard():
            self.order.reuse(name)
        return _pinned_scratch(turn, nbytes, self.device.type == "cuda"), name

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the copies queued so far are done (``RestoreOrder.after``)."""
        self.order.after(fn)

    def queue(self, *, upload: Callable[[], None], scatter: Callable[[], None], reads: object = None) -> None:
        """One chunk, under the device (``RestoreOrder.queue``)."""
        with self._failing(), self.guard():
            self.order.queue(upload=upload, scatter=scatter, reads=reads)

    def fetch(self, work: Callable[[], None]) -> None:
        """Device work and its copies to the host, waited for (``RestoreOrder.fetch``)."""
        with self._failing(), self.guard():
            self.order.fetch(work)

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._broken = True  # a chunk may be half queued or a wait failed: settle reports it
            raise

    def settle(self) -> bool:
        """Wait for every queued chunk, releasing what waited for them (before the owner blocks on
        a buffer the session may hold). False (logged) if the device failed: then no block of the
        load can be trusted to hold its record, and the buffers are released all the same."""
        try:
            with self.guard():
                self.order.finish()
        except Exception:
            log.exception("restoring into %s failed; the load's blocks will be recomputed", self.device)
            self._broken = True
        return not self._broken

    def finish(self) -> bool:
        """``settle``, before the load is reported: then nothing of it writes the engine's blocks."""
        return self.settle()

    def __enter__(self) -> RestoreSession:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """A one-chunk session: waits, and raises if the device failed (``settle`` does not)."""
        if exc_type is not None:
            self.settle()  # release what waits; the error in the block propagates
            return
        with self.guard():
            self.order.finish()


def restore_records(records: Sequence[np.ndarray], views: Sequence[torch.Tensor], device: torch.device,
                    block_ids: Sequence[int], *, record_bytes: int, header_bytes: int, layer_bytes: int,
                    chunk: np.ndarray | None = None, ops: Ops | None = None, stream: Any = None,
                    session: RestoreSession | None = None) -> None:
    """Scatter verified records into engine blocks ``block_ids``.

    ``chunk``: the records back to back in one host buffer (a staging slab), uploaded as is; the
    caller keeps it unwritten until the session says the copies are done (``session.after``).
    Otherwise ``records`` are packed into the session's pinned scratch first. Only pass records
    whose checksums were verified on the host.

    ``session``: the load this chunk belongs to; the copy stays in flight (the session waits for
    it). None: a one-chunk session (``ops``, ``stream``), waited for before returning.
    """
    n = len(block_ids)
    if n == 0:
        return
    if session is None:
        with RestoreSession(device, ops=ops or cuda_ops(), stream=stream) as one:
            _queue_restore(one, records, views, block_ids, record_bytes, header_bytes, layer_bytes, chunk)
        return
    _queue_restore(session, records, views, block_ids, record_bytes, header_bytes, layer_bytes, chunk)


def _queue_restore(session: RestoreSession, records: Sequence[np.ndarray], views: Sequence[torch.Tensor],
                   block_ids: Sequence[int], record_bytes: int, header_bytes: int, layer_bytes: int,
                   chunk: np.ndarray | None) -> None:
    from ..kernels import scatter_records

    n = len(block_ids)
    device = session.device
    pin = device.type == "cuda"
    reads: object = None
    if chunk is None:
        host, reads = session.scratch(n * record_bytes)
        packed = host.numpy().reshape(n, record_bytes)
        for i, r in enumerate(records):
            np.copyto(packed[i], r[:record_bytes])
    else:
        host = torch.from_numpy(chunk[: n * record_bytes])
    st: dict[str, torch.Tensor] = {}

    def upload() -> None:  # allocated on the restore stream: reused only in that stream's order
        st["ids"] = ids_on(block_ids, device)
        st["recs"] = host.to(device, non_blocking=True) if pin else host

    def scatter() -> None:
        scatter_records(st["recs"], views, st["ids"], record_bytes=record_bytes, header_bytes=header_bytes,
                        layer_bytes=layer_bytes)

    session.queue(upload=upload, scatter=scatter, reads=reads)
