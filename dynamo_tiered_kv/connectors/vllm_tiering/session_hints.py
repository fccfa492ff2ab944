"""A request's KV hints applied to the store by the vLLM secondary tier.

* ``kv.retain``: parsed once per request (``on_new_request``); every chunk the request stores,
  looks up or touches gets the retention its token range earns (``hints.plan_retention`` over
  the chunk's end position, prefix rule included) through ``TieredStore.retain``.
* Session end: ``X-Dynamo-Session-Final`` in ``kv_transfer_params`` (Dynamo forwards it there),
  or a retain at priority 0 over the whole request: when it finishes, its chunks and those
  retained under its session's ``kv.retain`` scope (earlier turns) are released and demoted.

Everything runs on vLLM's scheduler thread and never blocks on I/O: ``retain`` only updates the
retention tables, ``demote`` queues work on the store's loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...hints import BlockRetention, HintStats, RequestHints, plan_retention, read_hints
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


class HintApplier:
    """Applies one tier's requests' hints to its store (module docstring)."""

    def __init__(self, store: TieredStore, chunk_tokens: int | None, stats: HintStats | None = None) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens  # None: positions cannot be mapped (no vLLM spec): retain is off
        self.stats = stats or HintStats()
        self._scopes: OrderedDict[str, dict[BlockKey, None]] = OrderedDict()

    def on_new_request(self, req_context: Any) -> SessionHints:
        hints = read_hints(req_context, stats=self.stats)
        st = SessionHints(hints, session_final(getattr(req_context, "kv_transfer_params", None)))
        req_context.set_state(st)
        return st

    def on_keys(self, req_context: Any, keys: Sequence[Any], bks: Sequence[BlockKey]) -> None:
        """Chunks of the request (stored, looked up): retain them, remember them, maybe prefetch."""
        st = req_context.get_state(SessionHints)
        if st is None:
            return
        if len(st.keys) < MAX_TRACKED_CHUNKS:
            st.keys.update(dict.fromkeys(bks))
        retain = st.hints.retain if st.hints is not None else None
        if retain is None or self.chunk_tokens is None:
            return
        got: list[tuple[BlockKey, BlockRetention]] = []
        now = self.store.clock()
        for key, bk in zip(keys, bks):
            end = req_context.get_offload_key_position(key)
            if end is None or end < self.chunk_tokens:
                continue
            n = end // self.chunk_tokens
            plan = plan_retention(retain.directives, block_size=self.chunk_tokens, num_prompt_tokens=end,
                                  now=now, num_blocks=n)
            level = plan.at(n - 1)
            if level is not None:
                got.append((bk, level))
        if got:
            self.store.retain([k for k, _ in got], [r for _, r in got])
            if retain.scope is not None:
                self._remember(retain.scope, [k for k, _ in got])

    def _remember(self, scope: str, keys: list[BlockKey]) -> None:
        seen = self._scopes.pop(scope, None) or {}
        if len(seen) < MAX_TRACKED_CHUNKS:
            seen.update(dict.fromkeys(keys))
        self._scopes[scope] = seen
        while len(self._scopes) > MAX_SCOPES:
            self._scopes.popitem(last=False)

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
            keys.update(self._scopes.pop(scope, {}))
        if keys:
            self.store.demote(list(keys), wait=False)
