"""KV hints of our vLLM connector: the scheduler plans, every worker applies to its store.

The scheduler role reads a request's hints once (``read_hints``: ``request.kv_hints`` or
``kv_transfer_params``), turns its ``kv.retain`` directives into a per-block plan over the
prompt (``hints.plan_retention``, prefix rule included) and sends it with the next step's
metadata as a ``RetainSpec`` of token hashes; each worker maps the hashes to its store's keys
and calls ``TieredStore.retain`` (no I/O: the retention tables only). Blocks past the prompt's
full blocks are planned as the request saves them, with the tokens generated so far: that is
where ``covers_output`` directives take effect (the block holding the last prompt tokens and
the first generated ones gets the weaker of the two). When a session's final
request (``X-Dynamo-Session-Final``) or a request whose retain releases everything finishes, a
``RetainSpec(demote=True)`` releases its blocks and queues their demotion out of the host tier.

Prefetch: the scheduler remembers the blocks of each retained session (its ``kv.retain`` scope,
the last request's hashes; ``ScopeMemory``, bounded). A later request carrying a
``dtkv.prefetch`` for that scope sends ``RetainSpec(prefetch=True)`` with the wanted range, and
each worker queues ``TieredStore.prefetch`` (bounded, low priority, never waits).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ...hints import FETCH_ACTION, PREFETCH_ACTION, BlockRetention, HintStats, RequestHints, plan_retention
from ...store import TieredStore
from .metadata import RetainSpec


def plan_spec(hints: RequestHints | None, hashes: Sequence[bytes], *, block_size: int, num_prompt_tokens: int,
              num_output_tokens: int = 0, first: int = 0) -> RetainSpec | None:
    """The retention of blocks ``[first, len(hashes))`` of a request whose first ``len(hashes)``
    blocks these are, or None if it asks for none. ``num_output_tokens``: generated so far (what
    ``covers_output`` directives cover); earlier blocks still clamp later ones (prefix rule)."""
    claim = hints.retain if hints is not None else None
    if claim is None or len(hashes) <= first:
        return None
    plan = plan_retention(claim.directives, block_size=block_size, num_prompt_tokens=num_prompt_tokens,
                          num_output_tokens=num_output_tokens, now=time.time(), num_blocks=len(hashes))
    pairs = [(i, r) for i, r in plan.assign(list(range(len(hashes)))) if i >= first]
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
        if spec.prefetch:
            store.prefetch(keys)
            continue
        if spec.demote:
            store.demote(keys, wait=False)
            continue
        store.retain(keys, [BlockRetention(p, e) for p, e in zip(spec.priorities, spec.expiries)])


def note_fetch(hints: RequestHints | None, stats: HintStats) -> None:
    """``kv.fetch`` is counted, not acted on (``hints/prefetch.py`` says why)."""
    for _ in hints.fetch if hints is not None else ():
        stats.applied(FETCH_ACTION, "left_to_peer")


class ScopeMemory:
    """The block hashes of each retained session's last request, least recently used forgotten."""

    def __init__(self, max_scopes: int = 1024, stats: HintStats | None = None) -> None:
        self.max_scopes = max_scopes
        self.stats = stats or HintStats()
        self._hashes: OrderedDict[str, list[bytes]] = OrderedDict()

    def remember(self, hints: RequestHints | None, hashes: Sequence[bytes]) -> None:
        scope = hints.retain.scope if hints is not None and hints.retain is not None else None
        if scope is None or not hashes:
            return
        self._hashes.pop(scope, None)
        self._hashes[scope] = list(hashes)
        while len(self._hashes) > self.max_scopes:
            self._hashes.popitem(last=False)

    def forget(self, hints: RequestHints | None) -> None:
        scope = hints.retain.scope if hints is not None and hints.retain is not None else None
        if scope is not None:
            self._hashes.pop(scope, None)

    def prefetch_specs(self, hints: RequestHints | None, block_size: int) -> list[RetainSpec]:
        """``RetainSpec(prefetch=True)`` for each ``dtkv.prefetch`` naming a remembered session."""
        out: list[RetainSpec] = []
        for p in hints.prefetch if hints is not None else ():
            hashes = self._hashes.get(p.scope)
            if hashes is None:
                self.stats.applied(PREFETCH_ACTION, "unknown_scope")
                continue
            first = p.start // block_size
            end = len(hashes) if p.end is None else min(len(hashes), p.end // block_size)
            if first == 0 and end > 0:  # only a prefix can be restored
                out.append(RetainSpec(hashes[:end], prefetch=True))
                self.stats.applied(PREFETCH_ACTION, "queued")
            else:
                self.stats.applied(PREFETCH_ACTION, "empty_range")
        return out
