"""Hedged ranged GETs: a second identical GET when the first is late to answer.

A read whose first response byte has not arrived after the p99 first-byte latency of the
backend's recent GETs (``latency.GetLatency``; at least ``HEDGE_FLOOR_S``) sends one more GET of
the same range; whichever answers is used and the other is stopped. At most one hedge per read
and ``max_in_flight`` hedges per backend at once, so a slow server sees a few percent more
requests, never twice as many. No hedge is sent before the window holds enough GETs, nor when
the p99 is at the first-byte bound already (the server is stalled: a second GET would wait too).

Both GETs scatter into the same caller-owned buffers, so exactly one may write there: the first
to begin its body *owns* them (``Attempt.own``, called right before the first body byte is
stored, on the loop). From that instant the other one can never write: its task is cancelled
(its connection closed, never returned to a keep-alive pool half-read) and, should its own
body start before the cancellation lands, ``own`` answers False and it fails with
``HedgeLost`` without storing a byte. The read returns only after both attempts have finished.

Threads: everything here runs on the backend's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from .backend import BackendStats
from .handles import cancel_and_wait
from .latency import GetLatency

T = TypeVar("T")
HEDGE_FLOOR_S = 0.05  # never hedge sooner: below it a second GET mostly adds load
HEDGE_QUANTILE = 0.99


class HedgeLost(ConnectionError):
    """Another GET of the same read began its body first; this one stored nothing."""


class Attempt:
    """One GET of a range read, as its reader reports on it (loop thread only).

    The reader calls ``first_byte`` when the response's first byte arrives, ``no_first_byte``
    when it gives up waiting for it, ``own`` right before it stores the first body byte in the
    caller's buffers, and ``finished`` once the whole body is there.
    """

    __slots__ = ("_race", "first_at", "hedge", "recorded", "started_at", "task")

    def __init__(self, race: _Race, hedge: bool) -> None:
        self._race = race
        self.hedge = hedge
        self.started_at = time.monotonic()
        self.first_at: float | None = None
        self.recorded = False  # its first-byte latency (or the wait it gave up after) is in the window
        self.task: asyncio.Task | None = None  # None: runs in the caller's task (an unhedged read)

    def first_byte(self) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
            if not self.recorded:
                self.recorded = True
                self._race.latency.first_byte(self.first_at - self.started_at)

    def no_first_byte(self) -> None:
        """Given up (timed out, cancelled) without a first byte: the wait is recorded as a lower
        bound of its latency (a censored sample), so a stalled server raises the estimates."""
        if self.first_at is None and not self.recorded:
            self.recorded = True
            self._race.latency.first_byte(time.monotonic() - self.started_at)

    def own(self) -> bool:
        """True: this attempt alone stores into the caller's buffers from now on (every other
        attempt of the read is stopped); False: another one does, so this one must not."""
        return self._race.own(self)

    def finished(self, nbytes: int) -> None:
        if self.first_at is not None:
            self._race.latency.transfer(nbytes, time.monotonic() - self.first_at)


class _Race(Generic[T]):
    """The attempts of one read and which of them owns the caller's buffers."""

    def __init__(self, latency: GetLatency) -> None:
        self.latency = latency
        self.attempts: list[Attempt] = []
        self.owner: Attempt | None = None

    def own(self, a: Attempt) -> bool:
        if self.owner is None:
            self.owner = a
            for other in self.attempts:
                if other is not a and other.task is not None:
                    other.task.cancel()  # it never began its body: nothing of it is in the buffers
        return self.owner is a

    def attempt(self, hedge: bool) -> Attempt:
        a = Attempt(self, hedge)
        self.attempts.append(a)
        return a

    def spawn(self, read: Callable[[Attempt], Awaitable[T]], hedge: bool) -> Attempt:
        a = self.attempt(hedge)
        a.task = asyncio.ensure_future(read(a))
        return a


class Hedger:
    """Runs a backend's range reads, hedging late ones (module docstring).

    Args:
        latency: the backend's GET window (the hedge delay; every attempt records into it).
        stats: the backend's counters (``hedges_sent``, ``hedges_won``).
        max_in_flight: hedges outstanding at once, across the backend's reads.
        first_byte_timeout_s: the bound of one GET's first byte; no hedge when the p99 reached it.
        enabled: False: every read is one GET (the window is still kept).
    """

    def __init__(self, latency: GetLatency, stats: BackendStats, *, max_in_flight: int,
                 first_byte_timeout_s: float, enabled: bool = True) -> None:
        self.latency = latency
        self.stats = stats
        self.max_in_flight = max(1, max_in_flight)
        self.first_byte_timeout_s = first_byte_timeout_s
        self.enabled = enabled
        self.in_flight = 0

    def delay(self) -> float | None:
        """How long a read waits for its first byte before it hedges; None: it does not hedge."""
        if not self.enabled:
            return None
        p = self.latency.quantile(HEDGE_QUANTILE)
        if p is None:
            return None
        after = max(p, HEDGE_FLOOR_S)
        return after if after < self.first_byte_timeout_s else None

    async def run(self, read: Callable[[Attempt], Awaitable[T]]) -> T:
        """``read(attempt)`` once, plus a hedged second one if the first is late (module
        docstring). Returns the result of the attempt that answered; raises the first one's
        error when none did. Returns or raises only once no attempt runs any more."""
        race: _Race[T] = _Race(self.latency)
        delay = self.delay()
        if delay is None:
            only = race.attempt(hedge=False)
            try:
                return await read(only)
            except BaseException:
                only.no_first_byte()
                raise
        first = race.spawn(read, hedge=False)
        attempts = [first]
        hedged = False
        try:
            assert first.task is not None
            await asyncio.wait({first.task}, timeout=delay)
            if (not first.task.done() and first.first_at is None and race.owner is None
                    and self.in_flight < self.max_in_flight):
                hedged = True
                self.in_flight += 1
                self.stats.hedges_sent += 1
                attempts.append(race.spawn(read, hedge=True))
            while True:
                winner = _answered(attempts, race.owner)
                pending = {a.task for a in attempts if a.task is not None and not a.task.done()}
                if winner is not None or not pending:
                    break
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _stop(attempts)
            if hedged:
                self.in_flight -= 1
            if race.owner is None:  # nobody answered (a twin that lost to an answer says nothing)
                for a in attempts:
                    a.no_first_byte()
        if winner is None:
            raise _first_error(attempts)
        if winner.hedge:
            self.stats.hedges_won += 1
        assert winner.task is not None
        return winner.task.result()


def _answered(attempts: list[Attempt], owner: Attempt | None) -> Attempt | None:
    """The attempt whose result the read returns: the owner of the buffers once it succeeded,
    else one that succeeded without storing anything (a miss); None while neither."""
    ok = [a for a in attempts if a.task is not None and a.task.done() and not a.task.cancelled()
          and a.task.exception() is None]
    if owner is not None and owner in ok:
        return owner
    return next((a for a in ok if owner is None), None)


async def _stop(attempts: list[Attempt]) -> None:
    """Cancel the attempts still running and wait until each has ended (its connection closed),
    even if the caller is cancelled meanwhile (then re-raised)."""
    await cancel_and_wait([a.task for a in attempts if a.task is not None])


def _first_error(attempts: list[Attempt]) -> BaseException:
    """The error a failed read raises: the first attempt's, unless it only lost the race."""
    for a in attempts:
        assert a.task is not None
        e = None if a.task.cancelled() else a.task.exception()
        if e is not None and not isinstance(e, HedgeLost):
            return e
    return HedgeLost("no GET of the read answered")  # a ConnectionError: transient, retried
