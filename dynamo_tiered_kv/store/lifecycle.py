"""How a ``TieredStore`` stops: the shutdown sequence on its loop, and the process-exit hook.

Exit hook
---------
A process that ends without closing its store (an in-process vLLM engine, an offline batch job)
must still keep what it accepted: write the queued offloads, seal the open SSD segment, and flush
or hand over (the next start resumes unflushed sealed segments). ``atexit`` is too late for that:
``concurrent.futures`` stops every thread pool from ``threading._shutdown()``, which runs before
``atexit`` handlers, and then the SSD writer and ``asyncio.to_thread`` refuse new work. So the
first tracked store registers ``close_all`` with ``threading._register_atexit`` (run in reverse
order of registration: importing ``concurrent.futures.thread`` first puts ours before the thread
pools' hook), and with ``atexit`` as the fallback for interpreters without that hook. Multiprocessing
children run ``threading._shutdown()`` too (not ``atexit``), so every engine mode is covered.

Bound: all stores together get ``max(exit_timeout_s)`` (default 10 s) plus about a second to stop
their loop; what is not done by then is left to the next start's recovery.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread  # registers the pools' exit hook now, so ours (later) runs first
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..tiers.base import Tier

log = logging.getLogger(__name__)


class Closable(Protocol):
    """What the exit hook needs of a store (``store.TieredStore``)."""

    exit_timeout_s: float

    def close_by(self, deadline: float) -> None: ...


class Background(Protocol):
    """A long-running task the store drives on its loop (e.g. the SSD -> object flusher)."""

    async def run(self) -> None: ...

    async def stop(self) -> None: ...


# --- shutdown sequence (runs on the store's loop) ---------------------------------------------
async def run_background(b: Background) -> None:
    try:
        await b.run()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task %r failed; the store keeps serving without it", b)


async def persist(tiers: Sequence[Tier], background: Sequence[Background], flush_until: float) -> None:
    """Seal open segments, then let write-back tasks work until ``flush_until`` (monotonic).

    Every tier is sealed (``Tier.seal``; a no-op for tiers with nothing to seal); background tasks
    with ``drain(timeout)`` (or a ``flusher`` that has one) are drained. What is still unflushed at
    the bound stays sealed on the SSD and is flushed by the next start.
    """
    for t in tiers:
        try:
            await t.seal()
        except Exception as e:
            log.warning("sealing tier %s at close failed: %s", t.name, e)
    for b in background:
        drain = getattr(b, "drain", None) or getattr(getattr(b, "flusher", None), "drain", None)
        if drain is None:
            continue
        timeout = max(0.0, flush_until - time.monotonic())
        try:  # wait_for: a drain that overstays its timeout must not eat the time left to close tiers
            if not await asyncio.wait_for(drain(timeout), timeout + 0.5):
                log.warning("background task %r still had work after %.1fs at close; the next start resumes it",
                            b, timeout)
        except Exception as e:
            log.warning("draining background task %r at close failed: %s; the next start resumes it", b, e)


async def shut_down(tiers: Sequence[Tier], background: Sequence[Background], tasks: Sequence[asyncio.Task],
                    flush_until: float, end: float) -> None:
    """``persist``, then stop background tasks and close tiers, each bounded by ``end``."""
    await persist(tiers, background, flush_until)
    for b in background:
        try:
            await asyncio.wait_for(b.stop(), max(0.1, min(10.0, end - time.monotonic())))
        except Exception:
            log.exception("background task %r did not stop cleanly", b)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in tiers:
        try:
            await t.close()
        except Exception:
            log.exception("closing tier %s failed", t.name)


# --- process exit -------------------------------------------------------------------------------
_stores: weakref.WeakSet[Closable] = weakref.WeakSet()
_lock = threading.Lock()
_installed = False


def track(store: Closable) -> None:
    """Close ``store`` at interpreter exit unless it was closed before."""
    global _installed
    with _lock:
        _stores.add(store)
        if _installed:
            return
        _installed = True
    register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9, private
    if register is not None:
        with contextlib.suppress(RuntimeError):  # already shutting down: only the atexit fallback is left
            register(close_all)
    atexit.register(close_all)  # fallback; a no-op when the threading hook closed everything


def untrack(store: Closable) -> None:
    with _lock:
        _stores.discard(store)


def executors_stopped() -> bool:
    """True once Python has stopped its thread pools (``asyncio.to_thread`` and the SSD writer fail)."""
    return bool(getattr(concurrent.futures.thread, "_shutdown", False))


def close_all() -> None:
    """Close every store still open, sharing one bound. Never raises: the interpreter's own exit
    hooks (the thread pools') run after this one and must still run."""
    with _lock:
        stores = list(_stores)
        _stores.clear()
    if not stores:
        return
    budget = max(s.exit_timeout_s for s in stores)
    deadline = time.monotonic() + budget
    log.info("process exit: closing %d tiered KV store(s) within %.0fs", len(stores), budget)
    for s in stores:
        try:
            s.close_by(deadline)
        except Exception:
            log.exception("closing a tiered KV store at exit failed")


def _forget_after_fork() -> None:
    # A forked child has the parent's store objects but not their loop threads: never close those.
    global _stores, _lock
    _stores = weakref.WeakSet()
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_after_fork)
