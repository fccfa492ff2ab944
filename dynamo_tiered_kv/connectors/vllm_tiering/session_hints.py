"""A request's KV hints applied to the store by the vLLM secondary tier.

* ``kv.retain``: parsed once per request (``on_new_request``); every chunk the request stores,
  looks up or touches gets the retention its token range earns (``hints.plan_retention`` over
  the chunk's end position, prefix rule included) through ``TieredStore.retain``.
  ``covers_output`` needs the prompt length, which vLLM 0.33's ``ReqContext`` does not carry
  (``prompt_tokens``): the tier takes the prompt's chunk extent, so a chunk that holds the last
  prompt tokens and the first generated ones counts as generated.
* ``dtkv.prefetch``: a request naming a session (``scope``) this tier retained chunks for
  queues ``TieredStore.prefetch`` of those chunks in token order, cut to the hint's
  ``[start, end)`` in whole chunks, into the SSD tier: chunks only the object tier holds come
  up to the SSD while the request waits for its lookups and loads. What the store guarantees
  for it: the call only queues (bounded queue, 64 jobs; past that the hint is dropped and
  counted); a job takes a staging slab only when one is free at that moment and yields to the
  loop between batches, so loads a request waits on get the slabs first; it stops rather than
  take room held by protected blocks (``prefetch_stats.stopped_protected``); it promotes the
  leading chunks present somewhere below the SSD and stops at the first chunk no tier holds.
  No SSD tier (objects alone): nothing to promote into; counted.
* ``kv.fetch``: counted, not acted on (``hints/prefetch.py`` says why).
* Session end: ``X-Dynamo-Session-Final`` in ``kv_transfer_params`` (Dynamo forwards it there),
  or a retain at priority 0 over the whole request: when it finishes, its chunks and those
  retained under its session's ``kv.retain`` scope (earlier turns) are released and demoted.

What was done with each accepted prefetch or fetch action is counted in ``HintStats.applied``
(``dtkv_hint_applied_total{action,result}``). Everything runs on vLLM's scheduler thread and
never blocks on I/O: ``retain`` only updates the retention tables, ``prefetch`` and ``demote``
queue work on the store's loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...hints import FETCH_ACTION, PREFETCH_ACTION, BlockRetention, HintStats, RequestHints, plan_retention, read_hints
from ...keys import BlockKey
from ...store import TieredStore
from ..session_flags import session_final

log = logging.getLogger(__name__)

#: chunks of one request (or one scope) remembered for its demotion at most
MAX_TRACKED_CHUNKS = 1 << 16
#: scopes (sessions) whose retained chunks are remembered, least recently used forgotten first
MAX_SCOPES = 1024


@dataclass
class SessionHints:
    """Per-request state (``ReqContext.get_state(SessionHints)``)."""

    hints: RequestHints | None
    final: bool
    keys: dict[BlockKey, None] = field(default_factory=dict)  # chunks seen, in order
    prompt: int | None = None  # prompt tokens as far as known (``prompt_tokens``), fixed at first use


def prompt_tokens(req_context: Any) -> int | None:
    """The request's prompt length as far as the tier can know it, None if not at all.

    vLLM 0.33 passes the tier neither the prompt length nor the request. Its connector keys the
    prompt's full chunks (``set_offload_key_position``) before it looks any of them up or stores
    one, and keys generated chunks only as decoding fills them; so at the tier's first lookup or
    store of a request, the largest recorded position is the prompt rounded down to a chunk (or
    to a hash block, for a partial-tail lookup key), never past it.
    That table is private to vLLM: should it go, this answers None and generated chunks are
    planned as prompt (``covers_output`` then protects nothing: never more than asked).
    """
    exact = getattr(req_context, "num_prompt_tokens", None)  # a vLLM that carries it
    if isinstance(exact, int) and not isinstance(exact, bool):
        return exact
    positions = getattr(req_context, "_offload_key_positions", None)
    if isinstance(positions, Mapping) and positions:
        return max(int(p) for p in positions.values())
    return None


class HintApplier:
    """Applies one tier's requests' hints to its store (module docstring)."""

    def __init__(self, store: TieredStore, chunk_tokens: int | None, stats: HintStats | None = None) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens  # None: positions cannot be mapped (no vLLM spec): retain is off
        self.stats = stats or HintStats()
        # the tier a prefetch promotes into: the SSD (None: objects alone, nothing to promote into)
        self.prefetch_into = next((i for i, t in enumerate(store.tiers) if t.capabilities.medium == "ssd"), None)
        self._scopes: OrderedDict[str, dict[BlockKey, int]] = OrderedDict()  # retained chunk -> its index

    def on_new_request(self, req_context: Any) -> SessionHints:
        hints = read_hints(req_context, stats=self.stats)
        st = SessionHints(hints, session_final(getattr(req_context, "kv_transfer_params", None)))
        req_context.set_state(st)
        if hints is not None:
            self._prefetch(hints)
            for _ in hints.fetch:
                self.stats.applied(FETCH_ACTION, "left_to_peer")
        return st

    def on_keys(self, req_context: Any, keys: Sequence[Any], bks: Sequence[BlockKey]) -> None:
        """Chunks of the request (stored, looked up): retain them and remember them."""
        st = req_context.get_state(SessionHints)
        if st is None:
            return
        if len(st.keys) < MAX_TRACKED_CHUNKS:
            st.keys.update(dict.fromkeys(bks))
        retain = st.hints.retain if st.hints is not None else None
        if retain is None or self.chunk_tokens is None:
            return
        if st.prompt is None:
            st.prompt = prompt_tokens(req_context)
        got: list[tuple[BlockKey, BlockRetention, int]] = []
        now = self.store.clock()
        for key, bk in zip(keys, bks):
            end = req_context.get_offload_key_position(key)
            if end is None or end < self.chunk_tokens:
                continue
            n = end // self.chunk_tokens
            prompt = end if st.prompt is None else st.prompt
            plan = plan_retention(retain.directives, block_size=self.chunk_tokens, num_prompt_tokens=prompt,
                                  num_output_tokens=max(0, end - prompt), now=now, num_blocks=n)
            level = plan.at(n - 1)
            if level is not None:
                got.append((bk, level, n - 1))
        if got:
            self.store.retain([k for k, _, _ in got], [r for _, r, _ in got])
            if retain.scope is not None:
                self._remember(retain.scope, {k: i for k, _, i in got})

    def _remember(self, scope: str, chunks: dict[BlockKey, int]) -> None:
        seen = self._scopes.pop(scope, None) or {}
        if len(seen) < MAX_TRACKED_CHUNKS:
            seen.update(chunks)
        self._scopes[scope] = seen
        while len(self._scopes) > MAX_SCOPES:
            self._scopes.popitem(last=False)

    def _prefetch(self, hints: RequestHints) -> None:
        """Queue the promotion of each named session's retained chunks (module docstring)."""
        for p in hints.prefetch:
            chunks = self._scopes.get(p.scope)
            if chunks is None or self.chunk_tokens is None:
                self.stats.applied(PREFETCH_ACTION, "unknown_scope")
                continue
            if self.prefetch_into is None:
                self.stats.applied(PREFETCH_ACTION, "no_target")
                continue
            self._scopes.move_to_end(p.scope)
            # whole chunks from the one holding ``start``; past ``end`` a chunk's hash covers tokens
            # the next turn need not share, so a chunk that ends after ``end`` is left out
            first = p.start // self.chunk_tokens
            stop = None if p.end is None else p.end // self.chunk_tokens
            wanted = sorted((i, k) for k, i in chunks.items() if i >= first and (stop is None or i < stop))
            if not wanted:
                self.stats.applied(PREFETCH_ACTION, "empty_range")
                continue
            self.store.prefetch([k for _, k in wanted], into=self.prefetch_into)
            self.stats.applied(PREFETCH_ACTION, "queued")

    def on_request_finished(self, req_context: Any) -> None:
        st = req_context.get_state(SessionHints)
        if st is None:
            return
        released = st.hints is not None and st.hints.retain is not None and all(
            d.priority == 0 for d in st.hints.retain.directives)
        if not (st.final or released):
            return
        keys = dict(st.keys)
        scope = st.hints.retain.scope if st.hints is not None and st.hints.retain is not None else None
        if scope is not None:
            keys.update(dict.fromkeys(self._scopes.pop(scope, {})))
        if keys:
            self.store.demote(list(keys), wait=False)
