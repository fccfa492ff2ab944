"""From ``kv.retain`` directives to a (priority, expiry) per block of one request.

Rules, in order:

1. A token takes the strongest directive covering it: highest priority, then latest expiry
   (``now + duration``; no duration never expires). Priority 0 is a *release*: the block's
   protection is to be dropped (its expiry is meaningless and kept None). A token no directive
   covers is *untouched* (None): its block keeps whatever protection it has elsewhere.
2. A block gets what every one of its tokens asked for: the lowest priority and the earliest
   expiry among them; a block with an untouched token is untouched. Only whole blocks are
   cached, so a range ending mid-block does not protect that block.
3. Prefix rule: a block's protection never exceeds its predecessor's (priority and expiry are
   each clamped to the previous block's); a protected block after an untouched one is left
   untouched, after a released one it is released. A prefix cache serves a block only if all
   blocks before it survived, so protecting it beyond them would hold capacity for nothing.

The plan is computed per range: directives (at most 128) cut the token axis into a few hundred
pieces; only blocks that straddle a cut are looked at one by one, so the cost follows the
directives, not the blocks (docs/SESSIONS.md has the measurements).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .retain import MAX_PRIORITY, RetainDirective

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class BlockRetention:
    """``priority`` 1-100 protects until ``expiry`` (clock seconds; None never lapses); 0 releases."""

    priority: int
    expiry: float | None = None

    @property
    def released(self) -> bool:
        return self.priority == 0


Level = BlockRetention | None
_RELEASE = BlockRetention(0, None)
_UNCLAMPED = BlockRetention(MAX_PRIORITY + 1, None)  # the first block's cap: none


def _exp(e: float | None) -> float:
    return math.inf if e is None else e


def _stronger(a: Level, b: BlockRetention) -> BlockRetention:
    return b if a is None or (b.priority, _exp(b.expiry)) > (a.priority, _exp(a.expiry)) else a


def _weaker(a: BlockRetention, b: BlockRetention) -> BlockRetention:
    """Componentwise minimum: neither more priority nor a later expiry than either."""
    p = min(a.priority, b.priority)
    if p == 0:
        return _RELEASE
    e = a.expiry if _exp(a.expiry) <= _exp(b.expiry) else b.expiry
    return BlockRetention(p, e)


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """Per-block retention of one request, as ranges ``(first_block, end_block, level)``."""

    num_blocks: int
    ranges: tuple[tuple[int, int, Level], ...]

    def at(self, block: int) -> Level:
        """The retention of block ``block`` (None: untouched or out of range)."""
        if not 0 <= block < self.num_blocks:
            return None
        i = bisect.bisect_right(self.ranges, block, key=lambda r: r[0]) - 1
        return self.ranges[i][2]

    def blocks(self) -> list[Level]:
        out: list[Level] = []
        for first, end, level in self.ranges:
            out.extend([level] * (end - first))
        return out

    def assign(self, keys: Sequence[K]) -> list[tuple[K, BlockRetention]]:
        """``(key, retention)`` for the request's block keys in order, untouched blocks left out."""
        out: list[tuple[K, BlockRetention]] = []
        for first, end, level in self.ranges:
            if level is not None:
                out.extend((k, level) for k in keys[first:min(end, len(keys))])
        return out


def _token_ranges(directives: Iterable[RetainDirective], prompt: int, total: int, limit: int,
                  now: float) -> list[tuple[int, int, BlockRetention]]:
    out = []
    for d in directives:
        a, b = (prompt, total) if d.covers_output else (d.start, total if d.end is None else d.end)
        a, b = max(0, a), min(b, limit)
        if a >= b:
            continue
        level = _RELEASE if d.priority == 0 else BlockRetention(
            d.priority, None if d.duration is None else now + d.duration)
        out.append((a, b, level))
    return out


def _token_levels(ranges: list[tuple[int, int, BlockRetention]], limit: int) -> tuple[list[int], list[Level]]:
    """Cut [0, limit) at every range edge; the strongest level of each piece (rule 1)."""
    cuts = sorted({0, limit, *(a for a, _, _ in ranges), *(b for _, b, _ in ranges)})
    by_start = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    active: set[int] = set()  # sweep: only the ranges over the current piece are compared
    nxt = 0
    levels: list[Level] = []
    for lo in cuts[:-1]:
        while nxt < len(by_start) and ranges[by_start[nxt]][0] <= lo:
            active.add(by_start[nxt])
            nxt += 1
        active = {i for i in active if ranges[i][1] > lo}
        level: Level = None
        for i in active:
            level = _stronger(level, ranges[i][2])
        levels.append(level)
    return cuts, levels


def plan_retention(directives: Iterable[RetainDirective], *, block_size: int, num_prompt_tokens: int,
                   num_output_tokens: int = 0, now: float, num_blocks: int | None = None) -> RetentionPlan:
    """The retention of each block of a request (module docstring for the rules).

    Args:
        directives: a ``RetainClaim.directives``.
        block_size: tokens per block.
        num_prompt_tokens: where generated tokens start (``covers_output``).
        num_output_tokens: generated tokens so far (0 at admission).
        now: the clock expiries are measured on (``time.time()`` for retention that must survive
            restarts).
        num_blocks: blocks of the request (default: its full blocks).

    Raises:
        ValueError: a non-positive ``block_size`` or negative counts (caller errors, not hints).
    """
    if block_size <= 0 or num_prompt_tokens < 0 or num_output_tokens < 0:
        raise ValueError("block_size must be positive and token counts non-negative")
    total = num_prompt_tokens + num_output_tokens
    n = total // block_size if num_blocks is None else max(0, num_blocks)
    if n == 0:
        return RetentionPlan(0, ())
    limit = n * block_size
    cuts, levels = _token_levels(_token_ranges(directives, num_prompt_tokens, total, limit, now), limit)
    # Block ranges of uniform level: every cut inside a block isolates that block (rule 2).
    bcuts = sorted({0, n, *(c // block_size for c in cuts), *(-(-c // block_size) for c in cuts)})
    out: list[tuple[int, int, Level]] = []
    cap: Level = _UNCLAMPED
    for first, end in itertools.pairwise(bcuts):
        lo, hi = first * block_size, end * block_size
        i = bisect.bisect_right(cuts, lo) - 1
        level = levels[i]
        while level is not None and cuts[i + 1] < hi:  # a block straddling cuts: the weakest piece
            i += 1
            piece = levels[i]
            level = None if piece is None else _weaker(level, piece)
        # prefix rule (3)
        if level is None or level.released:
            cap = level
        elif cap is None:
            level = None
        else:
            level = cap = _weaker(level, cap)
        if out and out[-1][2] == level:
            out[-1] = (out[-1][0], end, level)
        else:
            out.append((first, end, level))
    return RetentionPlan(n, tuple(out))
