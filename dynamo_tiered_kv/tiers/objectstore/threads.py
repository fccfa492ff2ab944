"""Blocking calls in a worker thread that never outlive their caller."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread; on cancellation, return only once the thread has finished.

    A thread cannot be stopped, and it may be writing into the caller's buffers (a ranged read)
    or files the caller is about to close: raising ``CancelledError`` while it still runs would
    let the caller reuse them under it. Cancellation is delivered after the thread finishes.
    """
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({fut})
        raise
