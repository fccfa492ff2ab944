"""Prefetch actions: ``dtkv.prefetch@1.0`` (ours) and Dynamo's ``kv.fetch@1.0``. Parsing only.

``dtkv.prefetch@1.0``: a session is about to send its next turn; move its retained prefix up a
tier before it does. Payload::

    {"scope": str, "start": int, "end": int | null}

``scope`` (required, 1-256 characters) names the session as in its ``kv.retain`` actions;
``start`` (default 0) and ``end`` (default null: all of it) bound the token range wanted,
``end`` greater than ``start``. No other fields.

``kv.fetch@1.0`` (Dynamo router, ``lib/kv-router/src/kv_hints.rs``): another worker holds this
request's prefix. Payload::

    {"source_control_endpoint": str, "block_hashes": [int, ...], "mode": str}

``source_control_endpoint`` non-empty; ``block_hashes`` the source's 64-bit block hashes from
the first block on (``block_hashes[i]`` is request block ``i``), at least one, at most
``MAX_FETCH_HASHES``; ``mode`` optional. Other fields are ignored, as Dynamo's schema ignores
them. Both actions need major version 1.

What the adapters do with ``kv.fetch``: count it (``HintStats.applied``, result
``left_to_peer``) and nothing else. It asks for a copy from one peer's memory over a
peer-to-peer transport, which is not ours to open. What that peer wrote to the shared object
tier every node's lookup already finds by the request's own keys; the action's hashes are the
peer's engine hashes, which name none of our keys. A prefetch in its name would start with the
request's own lookup and load, in the same step, and read the same objects twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .envelope import HintAction, HintRejected
from .limits import MAX_FETCH_ACTIONS, MAX_FETCH_HASHES, MAX_PREFETCH_ACTIONS, MAX_SCOPE_CHARS
from .stats import HintStats

PREFETCH_ACTION = "dtkv.prefetch"
FETCH_ACTION = "kv.fetch"
_PREFETCH_FIELDS = frozenset({"scope", "start", "end"})
_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class PrefetchHint:
    """Bring tokens [start, end) of session ``scope`` up a tier (``end`` None: all retained)."""

    scope: str
    start: int = 0
    end: int | None = None


@dataclass(frozen=True, slots=True)
class FetchHint:
    """Dynamo's pointer to a peer holding this request's first ``len(block_hashes)`` blocks."""

    source_control_endpoint: str
    block_hashes: tuple[int, ...]
    mode: str | None = None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _frame(action: HintAction, kind: str) -> Mapping[str, Any]:
    if action.frame_error is not None:
        raise HintRejected(action.frame_error, "the action's frame is malformed")
    if action.major_version != 1:
        raise HintRejected("version", f"unsupported {kind} version {action.action_version!r}")
    return action.payload


def parse_prefetch(action: HintAction) -> PrefetchHint:
    """Raises ``HintRejected`` for an invalid ``dtkv.prefetch`` action."""
    p = _frame(action, PREFETCH_ACTION)
    unknown = set(p) - _PREFETCH_FIELDS
    if unknown:
        raise HintRejected("fields", f"unknown prefetch fields {sorted(map(str, unknown))}")
    scope = p.get("scope")
    if not isinstance(scope, str) or not 0 < len(scope) <= MAX_SCOPE_CHARS:
        raise HintRejected("scope", f"scope must be a string of 1-{MAX_SCOPE_CHARS} characters")
    start = p.get("start", 0)
    if not _is_int(start) or start < 0:
        raise HintRejected("start", "start must be a non-negative integer")
    end = p.get("end")
    if end is not None and (not _is_int(end) or end <= start):
        raise HintRejected("end", "end must be null or an integer greater than start")
    return PrefetchHint(scope, start, end)


def parse_fetch(action: HintAction) -> FetchHint:
    """Raises ``HintRejected`` for an invalid ``kv.fetch`` action."""
    p = _frame(action, FETCH_ACTION)
    source = p.get("source_control_endpoint")
    if not isinstance(source, str) or not source:
        raise HintRejected("source", "source_control_endpoint must be a non-empty string")
    hashes = p.get("block_hashes")
    if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_FETCH_HASHES:
        raise HintRejected("block_hashes", f"block_hashes must be a list of 1-{MAX_FETCH_HASHES} hashes")
    if not all(_is_int(h) and 0 <= h < _U64 for h in hashes):
        raise HintRejected("block_hashes", "block hashes must be unsigned 64-bit integers")
    mode = p.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise HintRejected("mode", "mode must be a string")
    return FetchHint(source, tuple(hashes), mode)


def collect_prefetch(actions: Iterable[HintAction], stats: HintStats) -> tuple[list[PrefetchHint], list[FetchHint]]:
    """The valid prefetch and fetch actions of an envelope; invalid ones are counted and skipped,
    and those past ``MAX_PREFETCH_ACTIONS``/``MAX_FETCH_ACTIONS`` valid ones are dropped (counted)."""
    prefetch: list[PrefetchHint] = []
    fetch: list[FetchHint] = []
    for action in actions:
        kind = action.action_type
        if kind not in (PREFETCH_ACTION, FETCH_ACTION):
            continue
        kept, cap = (prefetch, MAX_PREFETCH_ACTIONS) if kind == PREFETCH_ACTION else (fetch, MAX_FETCH_ACTIONS)
        if len(kept) >= cap:  # checked before parsing: a flood costs a counter, not a parse each
            stats.action(kind, "dropped")
            continue
        try:
            if kind == PREFETCH_ACTION:
                prefetch.append(parse_prefetch(action))
            else:
                fetch.append(parse_fetch(action))
        except HintRejected as e:
            stats.rejected(kind, e.code)
            stats.log.warning(f"{kind}:{e.code}", "%s action %r rejected: %.200s", kind, action.action_id[:64], e)
            continue
        stats.action(kind, "accepted")
    return prefetch, fetch
