"""Which device copy waits for which event, and when a buffer may be reused: the whole ordering of
the CUDA save and restore paths, in one place, over a minimal stream/event interface.

``Ops`` is the slice of ``torch.cuda`` the ordering needs (``cuda_ops()`` binds it); the work
itself (uploads, gathers, copies) is passed in as callables, which run with the given stream
current. Keeping the ordering apart from the work is what lets it be checked against a recording
stand-in without a GPU.

Save (the engine thread, between forward passes)::

    engine:  forward ... [fwd] ----------------------- wait(gathered) -> later kernels
    side:    ids H2D -> wait(fwd) -> gather -> [gathered] -> D2H into slab -> [copied]
    host (writer thread): copied.synchronize() -> checksums, headers -> the slab is readable

The engine thread never blocks. Later engine kernels, which may overwrite reused blocks, wait
only for the gather (a device-to-device copy), not for the slower D2H copy.

Restore (a restore thread; one ``RestoreOrder`` per load)::

    engine stream:  ... [mark] forward ... forward ...   (mark: recorded once, when the engine starts the load)
    restore stream: H2D chunk 0 -> wait(mark) -> scatter 0 -> [done 0] -> H2D chunk 1 -> wait(mark) -> scatter 1 ...
    host (restore thread): verify 0 | verify 1 | verify 2 ...   done_k.synchronize() only before the host
        reuses a buffer chunk k's copy reads, when ``depth`` chunks are in flight, and once at the end

Every chunk waits for the one mark only: forwards the engine queues after the load started never
delay it (they do not touch the load's blocks, which the engine does not use until the load is
reported). The host verifies chunk k+1 while chunk k's copy and scatter run. The host side never
touches a buffer between handing it to a copy and synchronizing an event recorded after that copy;
events on one stream complete in order, so one synchronize settles every chunk queued before it.

A GPU-direct chunk (records read into device memory) is checked on the device first::

    restore stream: checksums, header rows -> D2H (pinned) -> [fetched] -> ids -> wait(mark) -> scatter -> [done]
    host (restore thread): fetched.synchronize() (its one wait) -> check headers and sums -> queue the good ones
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol


class Event(Protocol):
    def record(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        """True once the work recorded before it has completed (never blocks)."""
        ...


class Stream(Protocol):
    def wait_event(self, event: Any) -> None: ...


class Ops(Protocol):
    def current_stream(self, device: Any) -> Any: ...

    def use(self, stream: Any) -> AbstractContextManager[Any]: ...

    def event(self) -> Any: ...


def order_gather(ops: Ops, device: Any, side: Any, *, upload_ids: Callable[[], None],
                 gather: Callable[[], None]) -> Any:
    """Queue ``gather`` (engine blocks -> a slab) on ``side`` after the work the engine queued so far
    (the forward that wrote the blocks), and make later engine work wait for the gather only.
    Returns the gather's event. Never blocks the host."""
    engine = ops.current_stream(device)
    fwd = ops.event()
    fwd.record(engine)  # everything the engine queued so far, i.e. the forward that wrote the blocks
    with ops.use(side):
        upload_ids()  # independent of the forward: overlaps it
        side.wait_event(fwd)
        gather()
        gathered = ops.event()
        gathered.record(side)
    engine.wait_event(gathered)  # a reused block is overwritten only after the gather read it
    return gathered


def order_save(ops: Ops, device: Any, side: Any, *, upload_ids: Callable[[], None], gather: Callable[[], None],
               download: Callable[[], None]) -> Any:
    """Queue a save on ``side``; returns the event after which the host slab holds the payloads."""
    order_gather(ops, device, side, upload_ids=upload_ids, gather=gather)
    with ops.use(side):
        download()  # after the gather: same stream
        copied = ops.event()
        copied.record(side)
    return copied


def mark_engine(ops: Ops, device: Any) -> Any:
    """The engine's point for one load: an event after everything queued so far on the calling
    thread's current stream of ``device``. Call on the engine thread when it starts the load (its
    stream is the current one there): kernels queued before may still read the load's blocks."""
    mark = ops.event()
    mark.record(ops.current_stream(device))
    return mark


class _Chunk:
    __slots__ = ("after", "done", "reads")

    def __init__(self, done: Any, reads: object) -> None:
        self.done, self.reads = done, reads
        self.after: list[Callable[[], None]] = []


class RestoreOrder:
    """The ordering of one load's restore chunks on one restore stream (module docstring).

    ``mark``: the engine's point (``mark_engine``); None records it here, on the calling thread's
    current stream (right for a caller on the engine thread: nothing is queued there meanwhile).
    ``depth``: most chunks queued and not yet waited for; beyond it the host waits for the oldest.
    Thread: the restoring thread only; the engine thread may only have recorded ``mark``.
    """

    def __init__(self, ops: Ops, device: Any, stream: Any, mark: Any = None, *, depth: int = 2) -> None:
        self.ops, self.stream, self.depth = ops, stream, max(1, depth)
        self.mark = mark if mark is not None else mark_engine(ops, device)
        self._pending: deque[_Chunk] = deque()  # queued, not known complete; oldest first

    def fetch(self, work: Callable[[], None]) -> None:
        """Queue ``work`` (device work and its copies to the host) and wait until it is done: the
        one host wait of a chunk whose records are checked on the device. Every chunk queued before
        is done then too."""
        with self.ops.use(self.stream):
            work()
            ev = self.ops.event()
            ev.record(self.stream)
        self._pending.append(_Chunk(ev, None))
        self._settle_through(len(self._pending) - 1)

    def queue(self, *, upload: Callable[[], None], scatter: Callable[[], None], reads: object = None) -> Any:
        """Queue one chunk: ``upload`` (host to restore-owned device memory) right away, ``scatter``
        (into engine blocks) after the mark. Returns the chunk's event. ``reads``: a host buffer
        the upload reads, which ``reuse`` waits for; the host must not write it before that."""
        self._retire_done()
        with self.ops.use(self.stream):
            upload()
            self.stream.wait_event(self.mark)  # the mark only: never forwards queued after it
            scatter()
            done = self.ops.event()
            done.record(self.stream)
        self._pending.append(_Chunk(done, reads))
        if len(self._pending) > self.depth:
            self._settle_through(len(self._pending) - 1 - self.depth)
        return done

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the release of a buffer the chunks read) once every chunk queued so far is
        done: at once if none is in flight, else when the host waits for the last of them."""
        if self._pending:
            self._pending[-1].after.append(fn)
        else:
            fn()

    def reuse(self, buffer: object) -> None:
        """Before the host writes ``buffer`` again: wait for the last queued chunk that reads it."""
        last = max((i for i, c in enumerate(self._pending) if c.reads is buffer), default=None)
        if last is not None:
            self._settle_through(last)

    def finish(self) -> None:
        """Wait until every queued chunk is in the engine's blocks and run what waited for them."""
        if self._pending:
            self._settle_through(len(self._pending) - 1)

    def in_flight(self) -> int:
        return len(self._pending)

    def _retire_done(self) -> None:
        """Release what waited for chunks already complete, without waiting."""
        while self._pending and self._pending[0].done.query():
            self._pop()

    def _settle_through(self, i: int) -> None:
        """One host wait for pending chunk ``i``; chunks complete in stream order, so every chunk up
        to it is done. Their ``after`` callbacks run even if the wait raised (a broken device)."""
        try:
            self._pending[i].done.synchronize()
        finally:
            for _ in range(i + 1):
                self._pop()

    def _pop(self) -> None:
        for fn in self._pending.popleft().after:
            fn()


def order_restore(ops: Ops, device: Any, restore: Any, *, upload: Callable[[], None],
                  scatter: Callable[[], None]) -> Any:
    """Queue a one-chunk restore on ``restore``, after everything queued so far on the calling
    thread's current stream; returns the event after which the blocks hold the records and the
    host chunk may be reused. For a caller on the engine thread; loads use ``RestoreOrder``."""
    return RestoreOrder(ops, device, restore).queue(upload=upload, scatter=scatter)


class _CudaOps:
    """``Ops`` over ``torch.cuda``. Events are blocking: ``synchronize`` sleeps in the driver
    instead of spinning a core while the copy engine works."""

    def current_stream(self, device: Any) -> Any:
        import torch

        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        import torch

        return torch.cuda.stream(stream)

    def event(self) -> Any:
        import torch

        return torch.cuda.Event(blocking=True)


class _Done:
    """A stream and an event of work that runs as it is queued (CPU tensors): nothing is ever pending."""

    def wait_event(self, event: Any) -> None:
        pass

    def record(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _InlineOps:
    """``Ops`` for CPU tensors: every step has run by the time it is queued."""

    stream = _Done()

    def current_stream(self, device: Any) -> Any:
        return self.stream

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def event(self) -> Any:
        return _Done()


_CUDA = _CudaOps()
_INLINE = _InlineOps()


def cuda_ops() -> Ops:
    return _CUDA


def inline_ops() -> Ops:
    """``Ops`` for work on CPU tensors, which runs as it is queued (its one stream: ``current_stream``)."""
    return _INLINE
