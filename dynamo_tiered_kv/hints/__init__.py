"""KV hints a request carries (vLLM ``kv_hints``, ``kv.retain@1.0`` and prefetch actions), parsed
into typed claims and a per-block retention plan. Pure parsing and planning: nothing here
touches a tier.

    hints = read_hints(request, stats=stats)          # None: no envelope, or a malformed one
    if hints and hints.retain:
        plan = plan_retention(hints.retain.directives, block_size=16,
                              num_prompt_tokens=n, now=time.time())
        for key, retention in plan.assign(block_keys): ...
"""

from .envelope import HintAction, HintEnvelope, HintRejected, MalformedEnvelope, coerce_envelope, raw_envelope
from .plan import BlockRetention, RetentionPlan, plan_retention
from .prefetch import FETCH_ACTION, PREFETCH_ACTION, FetchHint, PrefetchHint, parse_fetch, parse_prefetch
from .reader import RequestHints, parse_envelope, read_hints
from .retain import (
    MAX_DIRECTIVES,
    MAX_DURATION_S,
    MAX_PRIORITY,
    MAX_RETAIN_ACTIONS,
    RETAIN_ACTION,
    RetainClaim,
    RetainDirective,
    collect_retain,
    parse_retain,
)
from .stats import HintStats

__all__ = [
    "FETCH_ACTION",
    "MAX_DIRECTIVES",
    "MAX_DURATION_S",
    "MAX_PRIORITY",
    "MAX_RETAIN_ACTIONS",
    "PREFETCH_ACTION",
    "RETAIN_ACTION",
    "BlockRetention",
    "FetchHint",
    "HintAction",
    "HintEnvelope",
    "HintRejected",
    "HintStats",
    "MalformedEnvelope",
    "PrefetchHint",
    "RequestHints",
    "RetainClaim",
    "RetainDirective",
    "RetentionPlan",
    "coerce_envelope",
    "collect_retain",
    "parse_envelope",
    "parse_fetch",
    "parse_prefetch",
    "parse_retain",
    "plan_retention",
    "raw_envelope",
    "read_hints",
]
