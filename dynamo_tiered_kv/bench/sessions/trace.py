"""Agent-session traces for ``dtkv bench sessions``: who sends which turn when, on a compressed clock.

Shape after vLLM's AgentX figures (median 43 turns, ~142k input tokens per session, >96% of a
turn's prompt is the previous turn's): each session starts with a system prompt and repository
context, and every turn appends a tool result and an answer, so its context grows by a few
percent a turn. Tokens are scaled down by ``scale`` (the shape is kept, the bytes shrink).
Think times between turns are log-uniform from seconds to hours (tool runs, CI, a human); the
clock is simulated, nothing sleeps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass
class Session:
    sid: int
    system_tokens: int
    growth: list[int]  # tokens added before turn i (growth[0]: 0)
    start_s: float
    pauses: list[float]  # pause before turn i (pauses[0]: 0)
    tokens: list[int] = field(default_factory=list)  # the full token stream of its last turn

    @property
    def turns(self) -> int:
        return len(self.growth)

    def context(self, turn: int) -> int:
        return self.system_tokens + sum(self.growth[:turn + 1])

    def at(self, turn: int) -> float:
        return self.start_s + sum(self.pauses[:turn + 1])


@dataclass(frozen=True)
class TraceSpec:
    sessions: int
    median_turns: int
    tokens_per_session: int  # input tokens of a session's last turn, before scaling
    scale: int  # tokens divided by this
    min_pause_s: float
    max_pause_s: float
    spread_s: float  # sessions start uniformly over this much simulated time
    seed: int = 0


def make_trace(spec: TraceSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    out = []
    for sid in range(spec.sessions):
        turns = max(2, int(rng.lognormvariate(math.log(spec.median_turns), 0.35)))
        total = max(turns * 2, spec.tokens_per_session // spec.scale)
        system = int(total * rng.uniform(0.25, 0.4))  # system prompt and repository context
        per_turn = (total - system) / (turns - 1)
        growth = [0] + [max(1, int(per_turn * rng.uniform(0.5, 1.5))) for _ in range(turns - 1)]
        lo, hi = math.log(spec.min_pause_s), math.log(spec.max_pause_s)
        pauses = [0.0] + [math.exp(rng.uniform(lo, hi)) for _ in range(turns - 1)]
        s = Session(sid, system, growth, rng.uniform(0, spec.spread_s), pauses)
        s.tokens = [rng.randrange(1, 50_000) for _ in range(s.context(turns - 1))]
        out.append(s)
    return out


def events(trace: list[Session]) -> list[tuple[float, int, int]]:
    """``(time, session, turn)`` of every turn, in time order."""
    return sorted((s.at(t), s.sid, t) for s in trace for t in range(s.turns))


def overlap(trace: list[Session]) -> float:
    """Mean share of a resumed turn's prompt that is the previous turn's context."""
    shares = [s.context(t - 1) / s.context(t) for s in trace for t in range(1, s.turns)]
    return sum(shares) / max(1, len(shares))
