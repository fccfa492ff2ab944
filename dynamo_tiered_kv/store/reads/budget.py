"""How long a restore may wait on the object tier, and why a restore cut short by time was cut.

With ``recompute_tokens_per_s`` (the engine's prefill rate) set, a restore never waits on the
object tier longer than recomputing would take: its object-tier reads run under a ``ReadBudget``
of the tokens from the first block that tier serves to the end at that rate (at least
``BUDGET_FLOOR_S``; the load's own deadline if sooner). Both load paths (through staging slabs,
and straight into the caller's buffers) bound their reads this way and count a load cut short
once, by why: ``estimate`` (the tier sent nothing: it expected to miss), ``budget`` (the budget
ran out), ``deadline`` (the caller's timeout), ``stall`` (the tier gave up on a silent source).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ...blocks.keys import BlockKey
from ...tiers.base import ReadBudget, Tier

#: shortest object-tier budget of a restore: below it a GET's own latency would decide
BUDGET_FLOOR_S = 0.2


def restore_budget(rate: float | None, tiers: Sequence[Tier], fastest: Callable[[BlockKey], int | None],
                   block_tokens: int, keys: Sequence[BlockKey],
                   deadline: float | None) -> tuple[ReadBudget | None, bool]:
    """(the load's bound on its object-tier reads, whether recomputing rather than the load's
    deadline sets it); (None, False) when ``rate`` is off or no block comes from an object tier.
    ``deadline``: the load's own, on ``time.monotonic()``."""
    if not rate:
        return None, False
    first = next((j for j, k in enumerate(keys)
                  if (ti := fastest(k)) is not None and tiers[ti].capabilities.medium == "object"), None)
    if first is None:
        return None, False
    # failing at block ``first`` makes the engine recompute it and every block after it
    end = time.monotonic() + max(BUDGET_FLOOR_S, (len(keys) - first) * block_tokens / rate)
    if deadline is not None and deadline <= end:
        return ReadBudget(deadline), False
    return ReadBudget(end), True


def abandon_reason(budget: ReadBudget | None, binding: bool, deadline: float | None,
                   stalled: bool = False) -> str | None:
    """Why a load that restored fewer blocks than asked stopped, if time stopped it (the label of
    ``dtkv_restores_abandoned_total``); None for a miss or a record that failed verification."""
    gave_up = None if budget is None else budget.gave_up
    if gave_up == "estimate":
        return "estimate"
    if gave_up is not None:
        return "budget" if binding else "deadline"
    if deadline is not None and time.monotonic() >= deadline:
        return "deadline"
    if stalled:
        return "stall"
    return None
