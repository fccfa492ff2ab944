"""``TieredStore``'s retention service (``RetentionService``): retain, prefetch, demote, expire.

* ``retain(keys, retention, holder=...)``: the holder claims a retention class for blocks in
  every tier (``policy/retention.py``: others can only raise a block's class, a holder lowers or
  releases only its own claim); a block may be retained before it is written (a request's
  hints arrive before its KV). The store's own TTL sweep spares protected blocks, so a hint's
  duration (up to 30 days) outlives a tier's default TTL.
* ``prefetch(keys)``: bring the leading present blocks up into the host tier ahead of the
  request. A bounded low-priority queue on the loop: a full queue drops the request (counted);
  a job takes a staging slab only when one is free now and otherwise waits, so restores a
  request is waiting on always go first; it never makes room by evicting protected blocks (it
  counts every retained block's bytes as taken, present in the target tier or not, except the
  blocks it brings: a bound that costs one lookup per block of the job, not per retained block).
* ``demote(keys, holder=...)``: a session is done for now: the holder's claims are released,
  and its host blocks that no holder protects any more go down to the next written tier
  (written there first if missing) and leave the host tier; a block another holder still
  protects stays where it is.
* ``expire(now)``: one GC pass: each tier's own ``Tier.expire`` (blocks whose retention expired
  leave the tier, byte-bounded; the SSD tier also frees their disk bytes and seals its open
  segment if expired records lie in it; the object tier also drops objects past their TTL).
  Tiers report what they dropped to their residency hook, which forgets the store's TTL tracking
  and tells the residency listener.

Threads: ``retain`` runs on the caller's thread (the retention tables have their own locks);
``prefetch``/``demote`` queue work on the loop; ``expire`` runs on the loop (``RetentionService``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..blocks.keys import BlockKey
from ..policy.retention import ANONYMOUS, Holder, RetentionClasses
from ..tiers.base import ReadRequest

if TYPE_CHECKING:
    from ..hints.plan import BlockRetention
    from ..staging.device_slabs import DeviceSpan
    from ..staging.slabs import StagingPool
    from .state import StoreState

#: the writer's ``write_tier``: records into tier ``ti``, tracked for TTL and reported (loop)
WriteTier = Callable[[int, "list[tuple[BlockKey, memoryview | DeviceSpan]]"], Awaitable[None]]

log = logging.getLogger(__name__)

#: prefetch jobs waiting on the loop at most; more are dropped (a hint is advice)
PREFETCH_QUEUE = 64
#: how long a prefetch job waits for a free staging slab before it gives up
PREFETCH_SLAB_WAIT_S = 5.0


@dataclass
class PrefetchStats:
    queued: int = 0
    dropped: int = 0  # queue full
    blocks: int = 0  # promoted into the target tier
    bytes: int = 0
    stopped_protected: int = 0  # jobs cut short: the rest would have evicted protected blocks
    gave_up: int = 0  # no staging slab came free in time


@dataclass
class ExpireStats:
    """One ``expire`` pass: blocks and bytes dropped per tier name."""

    blocks: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)


class RetentionService:
    """Retain, prefetch, demote, expire and the TTL sweep over the store's tiers (module docstring).

    Built by ``TieredStore`` with the shared ``StoreState``, the staging pool (prefetch and demote
    take a slab only when one is free) and ``write_tier`` (the writer's: records into one tier,
    tracked and reported). Threads: ``retain``/``release`` on any thread (the retention tables have
    their own locks); ``prefetch``/``demote(wait=False)`` queue work on the loop and return;
    the coroutines (``_prefetch``, ``_demote``, ``expire_pass``, ``sweep``, the periodic passes)
    run on the loop; ``prefetch_stats`` and ``expire_passes`` are written by the loop only.
    """

    def __init__(self, state: StoreState, staging: StagingPool, write_tier: WriteTier, *, max_share: float,
                 clock: Callable[[], float], sweep_interval_s: float = 5.0, expire_interval_s: float = 300.0,
                 expire_pass_bytes: int = 1 << 30) -> None:
        self._state = state
        self.tiers = state.tiers
        self.staging = staging
        self._write_tier = write_tier
        self.clock = clock
        self.sweep_interval_s = sweep_interval_s
        self.expire_interval_s = expire_interval_s
        self.expire_pass_bytes = expire_pass_bytes
        self.expire_passes = 0  # periodic passes done (the loop writes it)
        self.prefetch_stats = PrefetchStats()
        self._prefetch_q: asyncio.Queue[tuple[list[BlockKey], int]] | None = None
        for ti, t in enumerate(self.tiers):
            cls = t.configure_retention(max_share=max_share, clock=clock)  # the tier's eviction honours it
            state.ttl[ti].keep = cls.protected  # the TTL sweep spares protected blocks

    def background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """(task name, coroutine) of the periodic passes to run on the loop (the store starts them
        and cancels them on close)."""
        out: list[tuple[str, Coroutine[Any, Any, None]]] = []
        if any(t.ttl_s is not None for t in self._state.ttl):
            out.append(("dtkv-ttl-sweep", self._sweep_forever()))
        if self.expire_interval_s > 0:
            out.append(("dtkv-expire", self._expire_forever()))
        return out

    def retention_of(self, ti: int) -> RetentionClasses:
        """Tier ``ti``'s retention table (the tier's own; its eviction honours it)."""
        return self.tiers[ti].retention

    # --- retain ---------------------------------------------------------------------------------
    def retain(self, keys: Sequence[BlockKey], retention: BlockRetention | Sequence[BlockRetention], *,
               holder: Holder = ANONYMOUS) -> int:
        """``holder`` claims a retention class for ``keys`` in every tier (one for all, or one per
        key; priority 0 releases this holder's claim only). Returns how many keys are protected
        afterwards in the fastest tier (by any holder)."""
        per_key = retention if isinstance(retention, Sequence) else [retention] * len(keys)
        if len(per_key) != len(keys):
            raise ValueError("one retention per key, or one for all")
        kept = 0
        for key, r in zip(keys, per_key):
            size = next((n for t in self.tiers if (n := t.size_of(key)) is not None), self._state.record_nbytes)
            for ti in range(len(self.tiers)):
                ok = self.retention_of(ti).set(key, r.priority, r.expiry, size, holder)
                kept += ok and ti == 0
        return kept

    def note_record_bytes(self, nbytes: int) -> None:
        """The size of one record (blocks retained before they exist count this much)."""
        self._state.record_nbytes = nbytes

    # --- prefetch -------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[BlockKey], *, into: int = 0) -> None:
        """Queue promotion of the leading present ``keys`` into tier ``into``; never waits (a full
        queue drops it, ``prefetch_stats.dropped``)."""
        keys = list(keys)
        try:
            self._state.loop.call_soon_threadsafe(self._enqueue_prefetch, keys, into)
        except RuntimeError:  # the store closed
            self.prefetch_stats.dropped += 1

    def _enqueue_prefetch(self, keys: list[BlockKey], into: int) -> bool:
        if self._prefetch_q is None:
            self._prefetch_q = asyncio.Queue(PREFETCH_QUEUE)
            self._state.bg_tasks.append(asyncio.ensure_future(self._prefetch_worker()))  # stopped on close
        try:
            self._prefetch_q.put_nowait((keys, into))
        except asyncio.QueueFull:
            self.prefetch_stats.dropped += 1
            return False
        self.prefetch_stats.queued += 1
        return True

    def prefetch_now(self, keys: Sequence[BlockKey], *, into: int = 0, timeout: float = 60.0) -> int:
        """Promote synchronously (tests, tools); returns blocks promoted."""
        return int(self._state.call(self._prefetch(list(keys), into), timeout=timeout))

    async def _prefetch_worker(self) -> None:
        assert self._prefetch_q is not None
        while True:
            keys, into = await self._prefetch_q.get()
            try:
                await self._prefetch(keys, into)
            except Exception:
                log.exception("prefetch of %d blocks failed", len(keys))

    async def _prefetch(self, keys: list[BlockKey], into: int) -> int:
        target = self.tiers[into]
        cls = self.retention_of(into)
        cap = target.usage().capacity_bytes
        todo: list[tuple[BlockKey, int, int]] = []  # (key, source tier, size)
        for key in keys:
            src = next((ti for ti, t in enumerate(self.tiers) if t.contains(key)), None)
            if src is None:
                break  # a prefix: nothing after a missing block can be served
            if src <= into:
                continue
            size = self.tiers[src].size_of(key)
            if size is None:
                break
            todo.append((key, src, size))
        # room that needs no protected block to go: capacity less every retained block's bytes
        # (an upper bound on those the target holds; the table keeps the sum, so this costs one
        # lookup per block here, not one per retained block), except the blocks brought now
        room = cap - cls.protected_bytes + sum(r.nbytes for key, _, _ in todo if (r := cls.get(key)) is not None)
        done = 0
        used = 0
        while todo:
            slab = await self._free_slab()
            if slab is None:
                self.prefetch_stats.gave_up += 1
                return done
            try:
                batch: list[tuple[BlockKey, int, int]] = []
                pos = 0
                while todo and pos + todo[0][2] <= slab.nbytes and todo[0][1] == (batch[0][1] if batch else todo[0][1]):
                    batch.append(todo.pop(0))
                    pos += batch[-1][2]
                if not batch:
                    return done
                if used + pos > room:
                    self.prefetch_stats.stopped_protected += 1
                    return done
                views, off = [], 0
                for _, _, n in batch:
                    views.append(slab.view[off:off + n])
                    off += n
                got = await self.tiers[batch[0][1]].read_many([ReadRequest(k, v) for (k, _, _), v in zip(batch, views)])
                ok = []
                for (k, _, n), v, g in zip(batch, views, got):
                    if g != n:
                        break
                    ok.append((k, v))
                if ok:
                    await self._write_tier(into, ok)
                    done += len(ok)
                    used += sum(v.nbytes for _, v in ok)
                    self.prefetch_stats.blocks += len(ok)
                    self.prefetch_stats.bytes += sum(v.nbytes for _, v in ok)
                if len(ok) < len(batch):
                    return done
            finally:
                self.staging.release(slab)
            await asyncio.sleep(0)  # let restores run between chunks
        return done

    async def _free_slab(self) -> Any:
        """A staging slab only when one is free (restores go first); None after the wait bound."""
        end = time.monotonic() + PREFETCH_SLAB_WAIT_S
        while True:
            slab = self.staging.try_acquire(0)
            if slab is not None or time.monotonic() >= end:
                return slab
            await asyncio.sleep(0.005)

    # --- demote ---------------------------------------------------------------------------------
    def demote(self, keys: Sequence[BlockKey], *, holder: Holder = ANONYMOUS, wait: bool = True) -> int:
        """Release ``holder``'s claims on ``keys`` in every tier and move the host blocks no holder
        protects any more to the next tier (a block another holder protects stays). Returns how
        many left the host tier (``wait=False``: queued on the loop, returns 0 at once)."""
        for ti in range(len(self.tiers)):
            self.retention_of(ti).release(keys, holder)
        if len(self.tiers) < 2 or self.tiers[0].capabilities.medium != "host":
            return 0
        if not wait:
            coro = self._demote(list(keys))
            try:
                asyncio.run_coroutine_threadsafe(coro, self._state.loop)
            except RuntimeError:  # the store closed
                coro.close()
            return 0
        return int(self._state.call(self._demote(list(keys)), timeout=60.0))

    async def _demote(self, keys: list[BlockKey]) -> int:
        host, down = self.tiers[0], self.tiers[1]
        moved = 0
        slab = await self._free_slab()
        if slab is None:
            return 0
        try:
            held = self.retention_of(0)  # read now: a claim made since the release keeps its block here
            todo = [k for k in keys if host.contains(k) and not held.protected(k)]
            i = 0
            while i < len(todo):
                batch, pos = [], 0
                while i < len(todo) and (n := host.size_of(todo[i])) is not None and pos + n <= slab.nbytes:
                    batch.append((todo[i], pos, n))
                    pos += n
                    i += 1
                if not batch:
                    break
                missing = [(k, slab.view[o:o + n]) for k, o, n in batch if not down.contains(k)]
                got = await host.read_many([ReadRequest(k, v) for k, v in missing])
                items = [(k, v) for (k, v), g in zip(missing, got) if g == v.nbytes]
                if items:
                    await self._write_tier(1, items)
                gone = [k for k, _, _ in batch if down.contains(k) and await host.delete(k)]
                self._state.ttl[0].forget(gone)
                self._state.tell(0, gone, stored=False)
                moved += len(gone)
        finally:
            self.staging.release(slab)
        return moved

    # --- expire ---------------------------------------------------------------------------------
    def expire(self, now: float | None = None, max_bytes: int = 1 << 30) -> ExpireStats:
        """One GC pass (module docstring); synchronous."""
        return self._state.call(self.expire_pass(now, max_bytes), timeout=120.0)  # type: ignore[no-any-return]

    async def expire_pass(self, now: float | None, max_bytes: int) -> ExpireStats:
        """One GC pass over every tier (``Tier.expire``: retained blocks whose expiry passed leave
        the tier, about ``max_bytes`` per tier; the tier reports them to its residency hook, which
        forgets their TTL tracking and tells the store's listener). Loop thread."""
        out = ExpireStats()
        for tier in self.tiers:
            when = tier.retention.clock() if now is None else now
            rep = await tier.expire(when, max_bytes)
            out.blocks[tier.name], out.bytes[tier.name] = rep.blocks, rep.bytes
        return out

    # --- periodic passes (loop) -------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            await self.sweep()

    def sweep_now(self, now: float | None = None) -> int:
        """One TTL sweep (``sweep``), synchronous (tests and tools); any thread but the loop's."""
        return int(self._state.call(self.sweep(now), timeout=60))

    async def sweep(self, now: float | None = None) -> int:
        """Delete blocks older than their tier's TTL (only those this store wrote). Returns count."""
        now = time.monotonic() if now is None else now
        n = 0
        for ti, ttl in enumerate(self._state.ttl):
            gone = []
            for key in ttl.expired(now):
                try:
                    if await self.tiers[ti].delete(key):
                        gone.append(key)
                except Exception as e:
                    log.warning("TTL delete from tier %s failed: %s", self.tiers[ti].name, e)
            n += len(gone)
            self._state.tell(ti, gone, stored=False)
        return n

    async def _expire_forever(self) -> None:
        """Every ``expire_interval_s``, one expiry pass on the loop (``expire_pass``), bounded by
        ``expire_pass_bytes``. A failed pass is logged and the next one runs as planned: a
        block whose retention passed must not stay forever because one pass hit a tier fault."""
        while True:
            await asyncio.sleep(self.expire_interval_s)
            try:
                rep = await self.expire_pass(None, self.expire_pass_bytes)
            except Exception as e:
                log.warning("expiry pass failed (the next runs in %.0fs): %s", self.expire_interval_s, e)
                continue
            self.expire_passes += 1
            if any(rep.blocks.values()):
                log.debug("expiry pass: %s blocks, %s bytes", rep.blocks, rep.bytes)
