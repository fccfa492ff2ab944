"""How long one ranged read may wait in silence, over all its attempts.

Each GET waits at most ``first_byte_timeout_s`` for its first response byte and
``body_idle_timeout_s`` of silence once its response has begun; the read's retries would pay
that again per attempt (four attempts: over 4 s on a gateway that answers nobody, where a
restore is worth waiting for only while it is sooner than recomputing). So a read keeps one
allowance across its attempts and their hedges:

* first-byte waits: ``STALL_WAITS`` bounds in all. A retry waits for its first byte only what is
  left (``bound``); a retry that would get less than ``MIN_FIRST_BYTE_SHARE`` of a bound is not
  sent;
* attempts ended by silence of either kind (no first byte, or a body quiet for the idle
  timeout: a reset that never arrives): ``STALL_WAITS`` in all.

Past either, the read fails with ``ReadStalled`` (not retried). The first silence may be one lost
request or a silently dropped keep-alive connection, which a retry on a fresh connection fixes;
a second one, the hedge's included, means the gateway answers nobody. An attempt ended by a
reset that did arrive, or by an error answer, spends nothing: such faults keep every retry, and
a slow body that keeps arriving is never cut.

Threads: one ``StallAllowance`` per read, used by that read's task on the backend's loop.
"""

from __future__ import annotations

import time

from ...errors import SourceStalled
from .direct_get import BodyStalled, FirstByteTimeout

#: first-byte bounds one read may wait in all, and attempts it may end in silence
STALL_WAITS = 2
#: a retry given less than this share of a first-byte bound is not sent (it could not answer)
MIN_FIRST_BYTE_SHARE = 0.25


class ReadStalled(SourceStalled):
    """A ranged read spent its allowance for silence (module docstring): the gateway is stalled,
    and one more attempt would only wait too. Not retried."""


class StallAllowance:
    """The silence one ranged read may still wait for (module docstring)."""

    def __init__(self, first_byte_timeout_s: float) -> None:
        self.first_byte_timeout_s = first_byte_timeout_s
        self.allowance_s = STALL_WAITS * first_byte_timeout_s
        self.waited_s = 0.0  # spent waiting for first bytes that never came
        self.silent = 0  # attempts ended in silence
        self._started = 0.0

    def bound(self) -> float:
        """The first-byte bound of the next attempt; call right before it starts."""
        self._started = time.monotonic()
        return min(self.first_byte_timeout_s, self.allowance_s - self.waited_s)

    def ended_in_silence(self, e: BodyStalled) -> ReadStalled | None:
        """The attempt that started at the last ``bound`` failed with ``e``: the error that ends
        the read once the allowance is spent, else None (``e`` stands and is retried)."""
        self.silent += 1
        if isinstance(e, FirstByteTimeout):
            self.waited_s += time.monotonic() - self._started
        left = self.allowance_s - self.waited_s
        if self.silent < STALL_WAITS and left >= MIN_FIRST_BYTE_SHARE * self.first_byte_timeout_s:
            return None
        return ReadStalled(f"{self.silent} attempts of this read ended in silence ({self.waited_s:.2f}s "
                           f"waiting for a first byte): {e}")
