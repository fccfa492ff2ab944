"""KV hints of our vLLM connector: the scheduler plans, every worker applies to its store.

The scheduler role reads a request's hints once (``read_hints``: ``request.kv_hints`` or
``kv_transfer_params``), turns its ``kv.retain`` directives into a per-block plan over the
prompt (``hints.plan_retention``, prefix rule included) and sends it with the next step's
metadata as a ``RetainSpec`` of token hashes; each worker maps the hashes to its store's keys
and calls ``TieredStore.retain`` (no I/O: the retention tables only). When a session's final
request (``X-Dynamo-Session-Final``) or a request whose retain releases everything finishes, a
``RetainSpec(demote=True)`` releases its blocks and queues their demotion out of the host tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ...hints import BlockRetention, RequestHints, plan_retention
from ...store import TieredStore
from .metadata import RetainSpec


def plan_spec(hints: RequestHints | None, hashes: Sequence[bytes], *, block_size: int,
              num_prompt_tokens: int) -> RetainSpec | None:
    """The retention of a request's first ``len(hashes)`` blocks, or None if it asks for none."""
    claim = hints.retain if hints is not None else None
    if claim is None or not hashes:
        return None
    plan = plan_retention(claim.directives, block_size=block_size, num_prompt_tokens=num_prompt_tokens,
                          now=time.time(), num_blocks=len(hashes))
    pairs = plan.assign(list(range(len(hashes))))
    if not pairs:
        return None
    return RetainSpec([hashes[i] for i, _ in pairs], [r.priority for _, r in pairs], [r.expiry for _, r in pairs])


def releases_all(hints: RequestHints | None) -> bool:
    claim = hints.retain if hints is not None else None
    return claim is not None and bool(claim.directives) and all(d.priority == 0 for d in claim.directives)


def apply_specs(store: TieredStore, specs: Sequence[RetainSpec],
                keys_of: Callable[[Sequence[bytes]], list[Any]]) -> None:
    """A worker's side: retain (or release and demote) the specs' blocks in its store."""
    for spec in specs:
        keys = keys_of(spec.token_hashes)
        if spec.demote:
            store.demote(keys, wait=False)
            continue
        store.retain(keys, [BlockRetention(p, e) for p, e in zip(spec.priorities, spec.expiries)])
