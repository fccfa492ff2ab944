"""Engine blocks whose load outcome is not known yet, and who computed over them.

A block restored by a load holds garbage if the load failed on any TP rank, and so does
everything computed over it. The scheduler learns which blocks failed only when the load's
outcome comes back (with async scheduling or pipeline parallelism, after later steps were
already built), and vLLM caches a synchronous load's blocks when it allocates them, so other
requests may take a prefix hit on them meanwhile. ``LoadOutcomes`` tracks which engine block ids
have an unknown outcome and, per request ("key"), which of them it computed over and which of
those failed, so the scheduler can hold that request's saves until every outcome is known.

Synchronous loads use the per-step calls: ``step_built`` as each step's metadata is built and
``step_output`` as each step's output comes back (vLLM returns them in step order, one per
step). An asynchronous path calls ``started`` and ``finished`` when it learns an outcome.
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
    #: steps built but not returned beyond which the oldest is given up on (a missed output):
    #: treated as failed, which stops saves of its holders but never stores garbage
    MAX_STEPS_IN_FLIGHT = 64

    def __init__(self) -> None:
        self._unknown: Counter[int] = Counter()  # block id -> loads of it in flight
        self._holders: dict[str, _Holder] = {}
        self._steps: deque[tuple[int, ...]] = deque()  # blocks loaded by each step in flight

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

    def step_built(self, loaded_block_ids: Iterable[int]) -> None:
        """A step's metadata was built, loading ``loaded_block_ids`` (possibly none)."""
        ids = tuple(loaded_block_ids)
        self.started(ids)
        self._steps.append(ids)
        if len(self._steps) > self.MAX_STEPS_IN_FLIGHT:
            oldest = self._steps.popleft()
            log.warning("no output for a step %d steps ago; treating its %d loaded blocks as failed",
                        self.MAX_STEPS_IN_FLIGHT, len(oldest))
            self.finished(oldest, oldest)

    def step_output(self, invalid_block_ids: Iterable[int]) -> None:
        """The oldest step in flight returned; ``invalid_block_ids`` failed to load on some rank."""
        if not self._steps:
            return
        self.finished(self._steps.popleft(), invalid_block_ids)

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
