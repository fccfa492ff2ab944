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

Restore (a restore thread)::

    engine default stream: ... [mark]
    restore: wait(mark) -> H2D chunk -> scatter -> [done]
    host (restore thread): done.synchronize() -> the pinned chunk may be reused, blocks reported

The host side never touches a pinned buffer between handing it to a copy and synchronizing the
copy's event.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Event(Protocol):
    def record(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...


class Stream(Protocol):
    def wait_event(self, event: Any) -> None: ...


class Ops(Protocol):
    def current_stream(self, device: Any) -> Any: ...

    def use(self, stream: Any) -> AbstractContextManager[Any]: ...

    def event(self) -> Any: ...


def order_save(ops: Ops, device: Any, side: Any, *, upload_ids: Callable[[], None], gather: Callable[[], None],
               download: Callable[[], None]) -> Any:
    """Queue a save on ``side``; returns the event after which the host slab holds the payloads."""
    engine = ops.current_stream(device)
    fwd = ops.event()
    fwd.record(engine)  # everything the engine queued so far, i.e. the forward that wrote the blocks
    with ops.use(side):
        upload_ids()  # independent of the forward: overlaps it
        side.wait_event(fwd)
        gather()
        gathered = ops.event()
        gathered.record(side)
        download()
        copied = ops.event()
        copied.record(side)
    engine.wait_event(gathered)  # a reused block is overwritten only after the gather read it
    return copied


def order_restore(ops: Ops, device: Any, restore: Any, *, upload: Callable[[], None],
                  scatter: Callable[[], None]) -> Any:
    """Queue a restore on ``restore``; returns the event after which the blocks hold the records and
    the host chunk may be reused. Call from the restore thread, under the engine's device."""
    mark = ops.event()
    mark.record(ops.current_stream(device))  # kernels queued before: they may still read the old blocks
    with ops.use(restore):
        restore.wait_event(mark)
        upload()
        scatter()
        done = ops.event()
        done.record(restore)
    return done


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


_CUDA = _CudaOps()


def cuda_ops() -> Ops:
    return _CUDA
