"""KV hints of our vLLM connector: the scheduler plans, every worker applies to its store.

The scheduler role reads a request's hints once (``read_hints``: ``request.kv_hints`` or
``kv_transfer_params``) and keeps its retention plan (``hints.sessions.RetentionCursor``: planned
once over the prompt, again only past a doubling horizon). It sends the plan's blocks with the
next step's metadata as a ``RetainSpec`` of token hashes under the request's holder (its tenant,
the namespace digest that its cache salt, LoRA and the tenant salt make, and its ``kv.retain``
scope); each worker maps the hashes to its store's keys and calls ``TieredStore.retain`` (no
I/O: the retention tables only). Blocks past the prompt's full blocks are planned as the
request saves them: that is where ``covers_output`` directives take effect (the block holding
the last prompt tokens and the first generated ones gets the weaker of the two). When a request
ending its session finishes (``hints.sessions.ends_session``), a ``RetainSpec(demote=True)``
releases its holder's claims on its blocks and on its session's earlier blocks, and queues
their demotion out of the host tier (blocks another holder still protects stay).

Prefetch: the scheduler remembers the blocks of each retained session per tenant
(``SessionScopes``: the last request's hashes, bounded). A later request of the same tenant
carrying a ``dtkv.prefetch`` for that scope sends ``RetainSpec(prefetch=True)`` with the wanted
whole blocks, and each worker queues ``TieredStore.prefetch`` (bounded, low priority, never
waits). Every bound is in ``hints.limits``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ...hints import FETCH_ACTION, PREFETCH_ACTION, BlockRetention, HintStats, RequestHints
from ...hints.sessions import Holder, RetentionCursor, SessionScopes
from ...store import TieredStore
from .metadata import RetainSpec


def retention_cursor(hints: RequestHints | None, *, block_size: int, prompt_tokens: int) -> RetentionCursor | None:
    """The request's retention plan, or None if it asks for none."""
    claim = hints.retain if hints is not None else None
    if claim is None:
        return None
    return RetentionCursor(claim, block_size=block_size, prompt_tokens=prompt_tokens, now=time.time())


def plan_spec(cursor: RetentionCursor | None, hashes: Sequence[bytes], owner: Holder, first: int = 0
              ) -> RetainSpec | None:
    """The retention of blocks ``[first, len(hashes))`` of the request whose first blocks
    ``hashes`` are, or None if it gives them none."""
    if cursor is None or len(hashes) <= first:
        return None
    levels = cursor.span(first, len(hashes))
    if not levels:
        return None
    return RetainSpec([hashes[i] for i, _ in levels], [r.priority for _, r in levels],
                      [r.expiry for _, r in levels], holder=owner)


def apply_specs(store: TieredStore, specs: Sequence[RetainSpec],
                keys_of: Callable[[Sequence[bytes]], list[Any]]) -> None:
    """A worker's side: retain (or release and demote, or prefetch) the specs' blocks in its store."""
    for spec in specs:
        keys = keys_of(spec.token_hashes)
        if spec.prefetch:
            store.prefetch(keys)
            continue
        if spec.demote:
            store.demote(keys, holder=spec.holder, wait=False)
            continue
        store.retain(keys, [BlockRetention(p, e) for p, e in zip(spec.priorities, spec.expiries)],
                     holder=spec.holder)


def note_fetch(hints: RequestHints | None, stats: HintStats) -> None:
    """``kv.fetch`` is counted, not acted on (``hints/prefetch.py`` says why)."""
    for _ in hints.fetch if hints is not None else ():
        stats.applied(FETCH_ACTION, "left_to_peer")


def prefetch_specs(scopes: SessionScopes[bytes], tenant: str, hints: RequestHints | None, block_size: int,
                   stats: HintStats) -> list[RetainSpec]:
    """``RetainSpec(prefetch=True)`` for each ``dtkv.prefetch`` naming a session of ``tenant``.

    Whole blocks from the one holding ``start``; a block ending past ``end`` is left out. Only a
    range from the first block can be restored by a prefix cache, but the store's prefetch stops
    at the first block no tier holds, so a later range costs no more than its blocks."""
    out: list[RetainSpec] = []
    for p in hints.prefetch if hints is not None else ():
        hashes = scopes.span((tenant, p.scope), p.start // block_size,
                             None if p.end is None else p.end // block_size)
        if hashes is None:
            stats.applied(PREFETCH_ACTION, "unknown_scope")
        elif not hashes:
            stats.applied(PREFETCH_ACTION, "empty_range")
        else:
            out.append(RetainSpec(hashes, prefetch=True))
            stats.applied(PREFETCH_ACTION, "queued")
    return out
