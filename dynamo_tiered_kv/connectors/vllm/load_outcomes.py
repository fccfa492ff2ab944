"""Engine blocks whose load outcome is not known yet, and who computed over them.

A block restored by a load holds garbage if the load failed on any TP rank, and so does
everything computed over it. The scheduler learns which blocks failed only when the load's
outcome comes back (with async scheduling or pipeline parallelism, after later steps were
already built), and vLLM caches a synchronous load's blocks when it allocates them, so other
requests may take a prefix hit on them meanwhile. ``LoadOutcomes`` tracks which engine block ids
have an unknown outcome and, per request ("key"), which of them it computed over and which of
those failed, so the scheduler can hold that request's saves until every outcome is known.

Synchronous loads use the per-step calls: ``step_built`` as each step's metadata is built and
``step_output`` as a step's output comes back. Outputs are paired with steps by the step number
the scheduler put in the step's metadata and the workers echo back (``metadata.StepEcho``), never
by counting: vLLM drops the output of a step without a forward whose connector output is empty
(``EMPTY_MODEL_RUNNER_OUTPUT``), so counts drift. An asynchronous path calls ``started`` and
``finished`` when it learns an outcome.

Owner: the engine core's scheduler thread only (``build_connector_meta``,
``update_connector_output`` and ``request_finished`` all run there); nothing here is locked.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class _Holder:
    waiting: set[int] = field(default_factory=set)  # touched blocks whose outcome is unknown
    failed: set[int] = field(default_factory=set)  # touched blocks that failed to load


class LoadOutcomes:
    """Load outcomes and their holders; the scheduler thread's alone (see module docstring)."""

    #: steps built but not returned beyond which the oldest is given up on (a missed output):
    #: treated as failed, which stops saves of its holders but never stores garbage
    MAX_STEPS_IN_FLIGHT = 64

    def __init__(self) -> None:
        self._unknown: Counter[int] = Counter()  # block id -> loads of it in flight
        self._holders: dict[str, _Holder] = {}
        #: (step number, blocks it loads) of each step built whose output is not back, oldest first
        self._steps: deque[tuple[int, tuple[int, ...]]] = deque()

    # --- outcomes --------------------------------------------------------------------------
    def started(self, block_ids: Iterable[int]) -> None:
        """A load into ``block_ids`` was issued; its outcome is unknown until ``finished``."""
        self._unknown.update(block_ids)

    def finished(self, block_ids: Iterable[int], failed: Iterable[int] = ()) -> None:
        """The outcome of a load into ``block_ids`` is known; ``failed`` are those that failed."""
        done = set(block_ids)
        bad = set(failed) & done
        for b in done:
            self._unknown[b] -= 1
            if self._unknown[b] <= 0:
                del self._unknown[b]
        for h in self._holders.values():
            hit = h.waiting & done
            if hit:
                h.failed |= hit & bad
                h.waiting -= {b for b in hit if b not in self._unknown}

    def step_built(self, step: int, loaded_block_ids: Iterable[int]) -> None:
        """Step ``step`` (increasing) was built, loading ``loaded_block_ids`` (possibly none)."""
        ids = tuple(loaded_block_ids)
        self.started(ids)
        self._steps.append((step, ids))
        if len(self._steps) > self.MAX_STEPS_IN_FLIGHT:
            self._give_up(self._steps.popleft(), f"no output for {self.MAX_STEPS_IN_FLIGHT} steps")

    def step_output(self, invalid_block_ids: Iterable[int], step: int | None) -> None:
        """Step ``step`` returned; ``invalid_block_ids`` failed to load on some rank.

        Outputs come back in step order, so a step older than ``step`` still in flight never
        returns: its loads count as failed. ``step`` None (an output without the workers' echo,
        which only an engine that drops connector worker metadata sends): the oldest step.
        """
        if step is None:
            if self._steps:
                self.finished(self._steps.popleft()[1], invalid_block_ids)
            return
        while self._steps and self._steps[0][0] < step:
            self._give_up(self._steps.popleft(), f"step {step} returned first")
        if self._steps and self._steps[0][0] == step:
            self.finished(self._steps.popleft()[1], invalid_block_ids)

    def _give_up(self, entry: tuple[int, tuple[int, ...]], why: str) -> None:
        step, ids = entry
        if ids:
            log.warning("no output for step %d (%s); treating its %d loaded blocks as failed", step, why,
                        len(ids))
        self.finished(ids, ids)

    def is_unknown(self, block_id: int) -> bool:
        return block_id in self._unknown

    # --- holders ---------------------------------------------------------------------------
    def touch(self, key: str, block_ids: Iterable[int]) -> None:
        """``key`` computes over ``block_ids``: note those whose load outcome is unknown."""
        unknown = {b for b in block_ids if b in self._unknown}
        if unknown:
            self._holders.setdefault(key, _Holder()).waiting |= unknown

    def settle(self, key: str) -> frozenset[int] | None:
        """None while an outcome ``key`` computed over is unknown; once all are known, the blocks
        among them that failed (empty: all loaded), and ``key`` is forgotten."""
        h = self._holders.get(key)
        if h is None:
            return frozenset()
        if h.waiting:
            return None
        del self._holders[key]
        return frozenset(h.failed)

    def forget(self, key: str) -> None:
        self._holders.pop(key, None)

    def __len__(self) -> int:
        """Number of engine blocks whose load outcome is unknown."""
        return len(self._unknown)
