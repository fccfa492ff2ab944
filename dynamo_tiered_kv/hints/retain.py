"""The ``kv.retain@1.0`` action: token ranges of a request, and how strongly to keep their blocks.

Payload::

    {"scope": str | null,             # 1-256 characters (``limits.MAX_SCOPE_CHARS``)
     "directives": [{"start": int, "end": int | null, "priority": int, "duration": number | null}
                    | {"covers_output": true, "priority": int, "duration": number | null}]}

The rules are vLLM's (``vllm/v1/kv_hints/retain.py`` on main after 0.33), applied as an executor
applies them: an invalid action is rejected alone and the valid ones still count; retain actions
past ``MAX_RETAIN_ACTIONS`` and directives past ``MAX_DIRECTIVES`` (per envelope) are dropped,
not rejected.

A directive: ``priority`` an integer in [0, 100] (0 releases the range; bools are not integers);
``start`` a non-negative integer (default 0); ``end`` null (the end of the sequence, generated
tokens included) or an integer greater than ``start``; ``duration`` null (no expiry) or a finite
number of seconds in [0, 30 days]; ``covers_output`` a boolean, and when true neither ``start``
nor ``end`` may be given (it names the generated tail, known only once the prompt length is).
No other fields. Within an action, ordered by ``start`` with ``covers_output`` directives last,
priorities must not increase: a prefix cache serves a block only if its predecessors survived.
All retain actions of an envelope must name the same ``scope``; a later one that differs is
rejected. The action's major version must be 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .envelope import HintAction, HintRejected
from .limits import MAX_DIRECTIVES, MAX_RETAIN_ACTIONS, MAX_SCOPE_CHARS
from .stats import HintStats

RETAIN_ACTION = "kv.retain"
RETAIN_MAJOR = 1
MAX_PRIORITY = 100
MAX_DURATION_S = 30 * 24 * 3600.0
_FIELDS = frozenset({"start", "end", "priority", "duration", "covers_output"})


@dataclass(frozen=True, slots=True)
class RetainDirective:
    """Keep tokens [start, end) at ``priority`` for ``duration`` seconds (None: no expiry).

    ``end`` None: to the end of the sequence. ``covers_output``: the generated tokens only
    (``start``/``end`` unused).
    """

    priority: int
    start: int = 0
    end: int | None = None
    duration: float | None = None
    covers_output: bool = False


@dataclass(frozen=True, slots=True)
class RetainClaim:
    """The accepted ``kv.retain`` directives of one envelope, in the order they came."""

    scope: str | None
    directives: tuple[RetainDirective, ...]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _directive(item: object) -> RetainDirective:
    if not isinstance(item, Mapping):
        raise HintRejected("directive", "each directive must be an object")
    unknown = set(item) - _FIELDS
    if unknown:
        raise HintRejected("fields", f"unknown directive fields {sorted(map(str, unknown))}")
    priority = item.get("priority")
    if not _is_int(priority) or not 0 <= priority <= MAX_PRIORITY:
        raise HintRejected("priority", f"priority must be an integer in [0, {MAX_PRIORITY}]")
    start = item.get("start", 0)
    if not _is_int(start) or start < 0:
        raise HintRejected("start", "start must be a non-negative integer")
    end = item.get("end")
    if end is not None and (not _is_int(end) or end <= start):
        raise HintRejected("end", "end must be null or an integer greater than start")
    duration = _duration(item.get("duration"))
    covers_output = item.get("covers_output", False)
    if not isinstance(covers_output, bool):
        raise HintRejected("covers_output", "covers_output must be a boolean")
    if covers_output and ("start" in item or "end" in item):
        raise HintRejected("covers_output", "covers_output cannot be combined with start or end")
    return RetainDirective(priority, start, end, duration, covers_output)


def _duration(raw: object) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise HintRejected("duration", "duration must be null or a number of seconds")
    try:
        seconds = float(raw)
    except OverflowError:  # an integer too large for a float
        raise HintRejected("duration", "duration out of range") from None
    # NaN fails both comparisons and infinity the upper bound: no expiry that never passes
    if not 0 <= seconds <= MAX_DURATION_S:
        raise HintRejected("duration", f"duration must be in [0, {MAX_DURATION_S:g}] seconds")
    return seconds


def check_order(directives: Sequence[RetainDirective]) -> None:
    """Raise ``HintRejected("order")`` if priorities increase along the token axis."""
    ranked = sorted(range(len(directives)),
                    key=lambda i: (math.inf if directives[i].covers_output else directives[i].start, i))
    prev: RetainDirective | None = None
    for i in ranked:
        d = directives[i]
        if prev is not None and d.priority > prev.priority:
            raise HintRejected("order", f"priority {d.priority} follows {prev.priority}: priorities must "
                               "not increase along the token axis")
        prev = d


def parse_retain(action: HintAction, budget: int = MAX_DIRECTIVES) -> tuple[RetainClaim, int]:
    """Parse one ``kv.retain`` action, keeping at most ``budget`` directives.

    Returns:
        The claim and how many directives were dropped past ``budget``.

    Raises:
        HintRejected: the action is invalid (its ``code`` says why).
    """
    if action.frame_error is not None:
        raise HintRejected(action.frame_error, "the action's frame is malformed")
    if action.major_version != RETAIN_MAJOR:
        raise HintRejected("version", f"unsupported {RETAIN_ACTION} version {action.action_version!r}")
    payload: Mapping[str, Any] = action.payload
    scope = payload.get("scope")
    if scope is not None and (not isinstance(scope, str) or not 0 < len(scope) <= MAX_SCOPE_CHARS):
        raise HintRejected("scope", f"scope must be null or a string of 1-{MAX_SCOPE_CHARS} characters")
    raw = payload.get("directives")
    if not isinstance(raw, list):
        raise HintRejected("directives", "directives must be a list")
    kept = raw[:max(0, budget)]
    directives = tuple(_directive(item) for item in kept)
    check_order(directives)
    return RetainClaim(scope, directives), len(raw) - len(kept)


def collect_retain(actions: Iterable[HintAction], stats: HintStats) -> RetainClaim | None:
    """Merge an envelope's ``kv.retain`` actions into one claim; None if none is usable.

    Invalid actions are rejected one by one (counted by reason, logged rate-limited); the
    first accepted action fixes the scope.
    """
    scope: str | None = None
    found = False
    directives: list[RetainDirective] = []
    seen = 0
    for action in actions:
        if action.action_type != RETAIN_ACTION:
            continue
        seen += 1
        if seen > MAX_RETAIN_ACTIONS:
            stats.action(RETAIN_ACTION, "dropped")
            continue
        try:
            claim, dropped = parse_retain(action, MAX_DIRECTIVES - len(directives))
            if found and claim.scope != scope:
                raise HintRejected("scope_conflict", "kv.retain actions of one envelope must share a scope")
        except HintRejected as e:
            stats.rejected(RETAIN_ACTION, e.code)
            stats.log.warning(f"{RETAIN_ACTION}:{e.code}", "kv.retain action %r rejected: %.200s",
                              action.action_id[:64], e)
            continue
        if dropped:
            stats.truncated_directives(dropped)
        stats.action(RETAIN_ACTION, "accepted")
        if not found:
            scope, found = claim.scope, True
        directives.extend(claim.directives)
    return RetainClaim(scope, tuple(directives)) if found else None
