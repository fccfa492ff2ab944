"""``StoreState``: what the store's parts (reader, writer, retention service) share, held in one
object each part is given explicitly.

Threads and ownership
---------------------
* ``loop``: the store's event loop, run by the ``dtkv-store`` thread (``TieredStore`` starts and
  stops it). ``call`` and ``schedule`` hand coroutines to it from any other thread.
* ``pending`` (offload batches and promotions not yet written): engine threads, loading threads
  and the loop; behind ``pending_lock`` (``idle`` waits on it).
* ``tasks`` and ``bg_tasks``: the loop thread only (``bg_tasks`` is cancelled on close).
* ``ttl`` (``policy.admission.Retention`` per tier): the loop and tiers' writer threads; each has
  its own lock.
* ``condemned`` (records that failed verification, until their delete is done): marked by the
  loading thread (``condemn``), cleared by the loop; single dict operations only (atomic under
  the GIL).
* ``saving`` (offload saves accepted and not yet finished, per tier and key): claimed by engine
  threads (``claim_saves``), released by the loop when that tier's write returned or failed
  (``release_saves``), dropped by ``condemn``; behind ``saving_lock``. Its size is bounded by the
  pending batches: at most ``max_pending`` slabs' worth of keys per written tier.
* ``residency``: replaced whole by the store's ``set_residency``; read anywhere.
* ``closed``: set once by the store's close (under its lock); read anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from ..blocks.keys import BlockKey
from ..policy.admission import Retention
from ..policy.residency import ResidencyListener, medium_of, notify
from ..tiers.base import Tier
from .metrics import StoreMetrics

log = logging.getLogger("dynamo_tiered_kv.store")


class StoreState:
    """The tiers, the loop and the bookkeeping the store's parts share (module docstring)."""

    def __init__(self, tiers: Sequence[Tier], metrics: StoreMetrics, ttl: Sequence[Retention],
                 loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self.tiers = list(tiers)
        self.metrics = metrics
        self.ttl = list(ttl)
        self.loop = loop
        self.max_pending = max_pending
        self.pending = 0
        self.pending_lock = threading.Lock()
        self.idle = threading.Condition(self.pending_lock)
        self.closed = False
        self.residency: ResidencyListener | None = None
        #: (tier, key) of records that failed verification whose delete is not done: gone for
        #: lookups, loads and offloads at once; set when the delete is done (``condemn``)
        self.condemned: dict[tuple[int, BlockKey], asyncio.Event] = {}
        #: (tier, key) -> the claim of the save in flight (``claim_saves``): a second save of a
        #: key to a tier is skipped while the first has not finished
        self.saving: dict[tuple[int, BlockKey], object] = {}
        self.saving_lock = threading.Lock()
        self.tasks: set[asyncio.Task] = set()
        self.bg_tasks: list[asyncio.Task] = []
        #: typical record size, for blocks retained before they are written (the writer sets it)
        self.record_nbytes = 0

    # --- running work on the loop -------------------------------------------------------------
    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop and wait for its result (any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def reserve_pending(self) -> bool:
        """Count one offload batch unless ``max_pending`` are queued already."""
        with self.pending_lock:
            if self.pending >= self.max_pending:
                return False
            self.pending += 1
            return True

    def finish_pending(self) -> None:
        with self.pending_lock:
            self.pending -= 1
            if self.pending == 0:
                self.idle.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no scheduled work is pending."""
        with self.idle:
            return self.idle.wait_for(lambda: self.pending == 0, timeout)

    def schedule(self, coro: Coroutine[Any, Any, Any], *, reserved: bool = False) -> None:
        """Run ``coro`` on the loop; ``drain`` waits for it. ``reserved``: the caller already counted it."""
        if not reserved:
            with self.pending_lock:
                self.pending += 1  # promotions and repairs are never refused: their slab is already ours
        try:
            self.loop.call_soon_threadsafe(self._spawn, coro)
        except RuntimeError:  # the store closed under an engine call in flight: drop the work, never raise
            coro.close()
            self.finish_pending()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.finish_pending()
        if not task.cancelled() and task.exception() is not None:
            log.error("store task failed", exc_info=task.exception())

    # --- what the tiers hold ------------------------------------------------------------------
    def holds(self, ti: int, key: BlockKey) -> bool:
        """Tier ``ti`` has a record of ``key`` that did not fail verification. Any thread."""
        # The map is almost always empty: test that first, so a lookup builds no (tier, key)
        # tuple. Its truth test is one atomic read like the membership test it guards, so a mark
        # made before this call (``condemn`` returns only once marked) is still seen.
        condemned = self.condemned
        if condemned and (ti, key) in condemned:
            return False
        return self.tiers[ti].contains(key)

    def fastest(self, key: BlockKey) -> int | None:
        """Index of the fastest tier that holds ``key``, or None."""
        for ti in range(len(self.tiers)):
            if self.holds(ti, key):
                return ti
        return None

    def tell(self, ti: int, keys: list[BlockKey], *, stored: bool) -> None:
        """Report ``keys`` stored in (or removed from) tier ``ti`` to the residency listener."""
        listener, medium = self.residency, medium_of(self.tiers[ti])
        if listener is not None and medium is not None and keys:
            notify(listener.stored if stored else listener.removed, medium, keys)

    # --- saves in flight -----------------------------------------------------------------------
    def claim_saves(self, wanted: Sequence[tuple[int, BlockKey]], claim: object) -> list[bool]:
        """Claim a save of each ``(tier, key)`` for ``claim`` (any thread; engine threads).

        Returns, per pair, True when claimed now, False when a save of that key to that tier is
        in flight already (claimed earlier, or earlier in ``wanted``): that save will store it, so
        writing it again would only store a second copy the tier then discards. The caller
        releases what it claimed with ``release_saves`` once the write returned, failed or was
        dropped, so a key whose save failed is saved by the next offload.
        """
        out: list[bool] = []
        with self.saving_lock:
            saving = self.saving
            for pair in wanted:
                if pair in saving:
                    out.append(False)
                else:
                    saving[pair] = claim
                    out.append(True)
        return out

    def release_saves(self, ti: int, keys: Sequence[BlockKey], claim: object) -> None:
        """End ``claim``'s saves of ``keys`` to tier ``ti`` (any thread). A pair claimed anew
        meanwhile (after a ``condemn``) belongs to the newer save and is left alone."""
        with self.saving_lock:
            saving = self.saving
            for key in keys:
                if saving.get((ti, key)) is claim:
                    del saving[(ti, key)]

    def condemn(self, ti: int, key: BlockKey) -> None:
        """Tier ``ti``'s record of ``key`` failed verification (loading thread): from now on it is
        gone for lookups and offloads, and the loop deletes it.

        Marked before this returns, because the engine saves the block it recomputes right after
        the failed load: were the record still held then, the save would be skipped as a duplicate
        and the delete would then leave the block stored nowhere. The fresh copy's write waits for
        the delete (the writer's ``write_tier``), so the delete never removes it.

        The save in flight of ``key`` to that tier, if any, no longer stands for the block: it may
        have passed its wait for deletes already and be deleted with the corrupt record. Its claim
        is dropped, so the fresh copy is saved (and waits for the delete) rather than skipped.
        """
        with self.saving_lock:
            self.saving.pop((ti, key), None)
        done = asyncio.Event()
        if self.condemned.setdefault((ti, key), done) is done:  # once per record until deleted
            self.schedule(self._forget(ti, key, done))

    async def _forget(self, ti: int, key: BlockKey, done: asyncio.Event) -> None:
        try:
            if await self.tiers[ti].delete(key):
                self.ttl[ti].forget([key])
                self.tell(ti, [key], stored=False)
        except Exception as e:
            log.warning("could not delete corrupt block %s from tier %s: %s", key.hex(), self.tiers[ti].name, e)
        finally:
            del self.condemned[(ti, key)]
            done.set()

    async def wait_condemned(self, ti: int, keys: Sequence[BlockKey]) -> None:
        """Wait until the deletes of tier ``ti``'s condemned records among ``keys`` are done (loop)."""
        if self.condemned:
            for key in keys:
                done = self.condemned.get((ti, key))
                if done is not None:
                    await done.wait()
