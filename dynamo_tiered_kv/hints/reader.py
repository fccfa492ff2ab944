"""One call per request: find its KV hints envelope, parse the actions we know, count the rest.

``read_hints`` never raises: a malformed envelope costs a counter and a rate-limited log line,
an invalid action costs only that action, and an unknown action is counted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .envelope import HintEnvelope, MalformedEnvelope, coerce_envelope, raw_envelope
from .prefetch import FETCH_ACTION, PREFETCH_ACTION, FetchHint, PrefetchHint, collect_prefetch
from .retain import RETAIN_ACTION, RetainClaim, collect_retain
from .stats import HintStats

KNOWN_ACTIONS = frozenset({RETAIN_ACTION, PREFETCH_ACTION, FETCH_ACTION})


@dataclass(frozen=True, slots=True)
class RequestHints:
    """What one request's envelope asks of us."""

    message_id: str
    retain: RetainClaim | None = None
    prefetch: tuple[PrefetchHint, ...] = ()
    fetch: tuple[FetchHint, ...] = ()
    ignored: tuple[str, ...] = field(default=())  # action types we do not implement


def parse_envelope(envelope: HintEnvelope, stats: HintStats) -> RequestHints:
    unknown = tuple(a.action_type for a in envelope.actions if a.action_type not in KNOWN_ACTIONS)
    if unknown:
        # never the type as a label: it is client text of unbounded variety
        stats.action("unknown", "ignored", len(unknown))
    if envelope.dropped_actions:
        stats.action("unknown", "dropped", envelope.dropped_actions)
    retain = collect_retain(envelope.actions, stats)
    prefetch, fetch = collect_prefetch(envelope.actions, stats)
    return RequestHints(envelope.message_id, retain, tuple(prefetch), tuple(fetch), unknown)


def read_hints(request: object = None, *, kv_transfer_params: object = None,
               stats: HintStats) -> RequestHints | None:
    """The hints of ``request`` (``kv_hints``, else its ``kv_transfer_params``), or None.

    ``kv_transfer_params`` alone may be given where there is no request object. None when the
    request carries no envelope or a malformed one.
    """
    try:
        raw = raw_envelope(request, kv_transfer_params)
        if raw is None:
            return None
        envelope = coerce_envelope(raw)
    except MalformedEnvelope as e:
        stats.envelope("malformed")
        stats.log.warning(f"envelope:{e.code}", "malformed KV hints envelope ignored: %.200s", e)
        return None
    except Exception as e:  # a request object whose attributes raise: no hints, never a failed request
        stats.envelope("malformed")
        stats.log.warning("envelope:unreadable", "unreadable KV hints envelope ignored: %s", type(e).__name__)
        return None
    stats.envelope("ok")
    try:
        return parse_envelope(envelope, stats)
    except Exception as e:  # a payload mapping whose methods raise; a bug here must not fail the request
        stats.envelope("unparsable")
        stats.log.warning("envelope:unparsable", "KV hints envelope %r not parsed: %s",
                          envelope.message_id[:64], type(e).__name__)
        return None
