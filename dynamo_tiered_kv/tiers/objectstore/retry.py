"""Retries with jittered backoff and a circuit breaker, shared by the object backends.

A transient fault (5xx, SlowDown, timeouts, resets) is retried up to ``max_attempts`` times with
"full jitter" backoff: attempt ``n`` sleeps ``uniform(0, min(max_delay, base * 2**n))``, so many
clients hitting one overloaded server spread out instead of retrying in lockstep. Every attempt
has its own timeout, so a call is bounded by roughly ``max_attempts * (attempt_timeout + max_delay)``.

A caller with a deadline of its own (the object tier's ``read_timeout_s``) runs its calls inside
``shared_deadline``: then every attempt gets at most its share of the time left (``left /
attempts left``) and no attempt or backoff starts past the deadline. One attempt stuck on a
connection that went silent can no longer spend the whole budget: the retries still run, and
the call raises ``TierUnavailable`` before the caller's own timeout (``DeadlineReached`` when it
was the deadline that ended it).

The breaker counts operations that failed *after* their retries. ``failure_threshold`` of them in
a row open it: calls then fail at once with ``TierUnavailable`` (no network traffic) for
``cooldown_s``. After that one call at a time is let through as a probe (half-open); a success
closes the breaker, a failure re-opens it for another cooldown.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ...errors import TierUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
_rng = random.Random()
# the monotonic deadline of the calls of this context (tasks created inside inherit it)
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("dtkv_retry_deadline", default=None)


class DeadlineReached(TierUnavailable):
    """A retried call ran out of its ``shared_deadline`` (the time, not the retries, ran out)."""


@contextlib.contextmanager
def shared_deadline(seconds: float) -> Iterator[None]:
    """Retried calls made inside (in tasks created inside, too) end within ``seconds`` from now.
    An enclosing earlier deadline stays in force."""
    end = time.monotonic() + seconds
    outer = _deadline.get()
    token = _deadline.set(end if outer is None else min(outer, end))
    try:
        yield
    finally:
        _deadline.reset(token)


def detach_deadline() -> None:
    """Lift the ``shared_deadline`` for the rest of the current task (one started inside it that
    outlives the caller: a quarantine marker, a delete); a task's context is its own copy, so
    nothing outside it changes."""
    _deadline.set(None)


@dataclass(frozen=True)
class RetryPolicy:
    """How one backend operation is retried.

    Attributes:
        max_attempts: tries per operation, including the first (1 disables retries).
        base_delay_s: backoff scale; attempt ``n`` waits up to ``base * 2**n`` seconds.
        max_delay_s: cap of one backoff sleep.
        attempt_timeout_s: limit of one attempt (connect + transfer), after which it is retried.
    """

    max_attempts: int = 4
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    attempt_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < 0 or self.attempt_timeout_s <= 0:
            raise ValueError(f"invalid RetryPolicy {self}")

    def backoff(self, attempt: int) -> float:
        return _rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2 ** attempt)))


class CircuitBreaker:
    """Stops calls to a dead endpoint; lets one probe through after ``cooldown_s``."""

    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or cooldown_s < 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown_s >= 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False
        self.opened_count = 0  # times the breaker tripped (metrics)

    @property
    def state(self) -> str:
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until or self._probing else "half-open"

    def before_call(self) -> bool:
        """Raise ``TierUnavailable`` if calls are blocked; return True if this call is the probe."""
        if self._open_until is None:
            return False
        if self._clock() < self._open_until or self._probing:
            raise TierUnavailable("object store circuit breaker is open (endpoint failing)")
        self._probing = True
        return True

    def on_success(self, probe: bool) -> None:
        if probe or self._failures:
            self._failures = 0
        if probe:
            log.info("object store reachable again; circuit breaker closed")
            self._probing = False
            self._open_until = None

    def on_failure(self, probe: bool) -> None:
        self._failures += 1
        if probe or self._failures >= self.failure_threshold:
            if self._open_until is None:
                self.opened_count += 1
                log.warning("object store failing (%d in a row); circuit breaker open for %.1fs",
                            self._failures, self.cooldown_s)
            self._open_until = self._clock() + self.cooldown_s
            self._probing = False


async def with_timeout(aw: Awaitable[T], seconds: float) -> T:
    """``await aw`` for at most ``seconds`` (raises ``TimeoutError``).

    Uses ``asyncio.timeout`` where available: Python 3.11's ``wait_for`` can swallow a
    cancellation that races with completion, which would make shutdown hang.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover - Python 3.10


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` up to ``seconds``; True if it is set. Cancellation always propagates."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=seconds)
    finally:
        waiter.cancel()
    return event.is_set()


async def call_with_retries(attempt: Callable[[], Awaitable[T]], *, policy: RetryPolicy,
                            breaker: CircuitBreaker, is_transient: Callable[[BaseException], bool],
                            what: str, on_retry: Callable[[], None] | None = None) -> T:
    """Run ``attempt()`` under the policy and breaker.

    ``attempt`` returns normally for outcomes that are not faults (including "missing"); it raises
    for faults. Transient faults (``is_transient``) and attempt timeouts are retried.

    Raises:
        TierUnavailable: breaker open, a permanent fault, or retries exhausted.
    """
    probe = breaker.before_call()
    last: BaseException | None = None
    deadline = _deadline.get()
    tries = 0
    out_of_time = False  # the deadline, not the attempts, ended the call
    for n in range(policy.max_attempts):
        limit = policy.attempt_timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                out_of_time = True
                break
            limit = min(limit, left / (policy.max_attempts - n))  # the later attempts keep their share
        tries += 1
        try:
            result = await with_timeout(attempt(), limit)
        except asyncio.CancelledError:
            if probe:
                breaker.on_failure(True)
            raise
        except (asyncio.TimeoutError, TimeoutError) as e:
            last = e
            out_of_time = limit < policy.attempt_timeout_s  # its share of the deadline was its bound
        except Exception as e:
            if not is_transient(e):
                breaker.on_failure(probe)
                raise TierUnavailable(f"{what} failed: {type(e).__name__}: {e}") from e
            last = e
            out_of_time = False
        else:
            breaker.on_success(probe)
            return result
        if n + 1 < policy.max_attempts:
            delay = policy.backoff(n)
            if deadline is not None and time.monotonic() + delay >= deadline:
                out_of_time = True
                break
            if on_retry is not None:
                on_retry()
            log.debug("%s: transient %s, retry %d", what, type(last).__name__, n + 1)
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                if probe:  # else the breaker would wait for this probe's outcome for ever
                    breaker.on_failure(True)
                raise
    breaker.on_failure(probe)
    why = f"{type(last).__name__}: {last}" if last is not None else "no time left"
    error = DeadlineReached if out_of_time else TierUnavailable
    raise error(f"{what} failed after {tries} attempts"
                f"{' (deadline reached)' if out_of_time else ''}: {why}") from last
