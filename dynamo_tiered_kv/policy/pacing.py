"""Pacing a restore's CPU work against the engine's steps.

On a CPU engine the forward keeps every core busy (vLLM's OpenMP team spin-waits between parallel
regions), so a restore's verify+scatter on a background thread runs only by taking a core from the
forward, and a step that overlaps it stretches by the whole of it: a 63 MiB restore's ~20 ms of
verify+scatter turned 6 ms decode steps into 20-60 ms ones. A pacer lets the restore's CPU work
through in slices, at most a share of each engine step while other requests run a forward, and
without a limit while the engine has nothing else to do (then nobody waits on the cores).

The store asks ``admit`` before each slice and reports the slice's time with ``spent``; the engine
adapter calls ``StepShare.step`` once per engine step. The store knows no engine: any caller may
pass a pacer (or none: unpaced).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

#: Bytes of records verified and scattered per paced slice: ~0.3-0.5 ms of work at 4-6 GB/s, small
#: enough for a step's share, large enough that the per-call cost of a batch decode stays small.
SLICE_BYTES = 2 << 20


class Pacer(Protocol):
    def admit(self, deadline: float | None) -> None:
        """Block until the next slice may run (or ``deadline``, a ``time.monotonic`` value, passes)."""

    def spent(self, seconds: float) -> None:
        """A slice admitted by ``admit`` took ``seconds``."""

    def limiting(self) -> bool:
        """True while slices are being held back (the store then reads fewer chunks ahead)."""


class StepShare:
    """Grants each busy engine step ``share`` of that step's duration (the previous step's, as
    measured between calls of ``step``); slices wait for the next grant once it is used up.

    Overruns are carried as debt into the next step, unused time is not saved up (a burst after a
    quiet stretch would stall the step that admits it). If no step comes for ``stall_s`` (a long
    forward, or the engine stopped stepping), a waiting slice runs anyway: a restore must end by its
    deadline, and a stalled engine has no step to protect.

    Threads: ``step`` on the engine thread, ``admit``/``spent`` on restoring threads (several loads
    may share one pacer). Credit, the idle flag, the last step's time and ``waited_s`` change only
    under ``_cond``; ``limiting`` reads the flag alone (one attribute: a snapshot).
    """

    def __init__(self, share: float, stall_s: float = 0.05, first_step_s: float = 0.01) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.share = share
        self.stall_s = stall_s
        self._first_step_s = first_step_s
        self._cond = threading.Condition()
        self._credit = 0.0
        self._free = True  # no forward of other requests running: no limit
        self._last_step: float | None = None
        self.waited_s = 0.0  # total time slices spent waiting for a grant (for metrics/benchmarks)

    def step(self, busy: bool) -> None:
        """Engine thread, once per step before its forward; ``busy``: the step runs a forward."""
        now = time.monotonic()
        with self._cond:
            step_s = self._first_step_s if self._last_step is None else now - self._last_step
            self._last_step = now
            self._free = not busy
            if busy:
                self._credit = min(self._credit, 0.0) + self.share * step_s
            self._cond.notify_all()

    def admit(self, deadline: float | None) -> None:
        t0 = time.monotonic()
        with self._cond:
            while not self._free and self._credit <= 0:
                wait = self.stall_s if deadline is None else min(self.stall_s, deadline - time.monotonic())
                if wait <= 0 or not self._cond.wait(wait):
                    break  # no grant for stall_s, or the restore's deadline: run the slice anyway
            self.waited_s += time.monotonic() - t0

    def spent(self, seconds: float) -> None:
        with self._cond:
            if not self._free:
                self._credit -= seconds

    def limiting(self) -> bool:
        return not self._free
