"""A request's KV hints applied to the store by the vLLM secondary tier.

* ``kv.retain``: parsed once per request (``on_new_request``) and planned once
  (``hints.sessions.RetentionCursor``); every chunk the request stores or looks up gets the
  retention its token range earns through ``TieredStore.retain``, once per chunk and request
  (a table lookup per chunk after that: vLLM 0.33 looks a chunk up, and stores it, under its
  manager lock on the scheduler thread, often one 16-token chunk at a time).
  ``covers_output`` needs the prompt length, which vLLM 0.33's ``ReqContext`` does not carry
  (``prompt_tokens``): the tier takes the prompt's chunk extent, so a chunk that holds the last
  prompt tokens and the first generated ones counts as generated.
* Who holds it: vLLM 0.33 hands the tier neither the request nor its ``cache_salt`` (it is inside
  vLLM's block hashes). The tier takes the request's first chunk key as its tenant: that key
  chains the cache salt (and LoRA) with the first tokens, so two requests share it only when
  they could read each other's chunks anyway. Retention is held by (that key's digest, the
  ``kv.retain`` scope); a request raises others' retention, never lowers or releases it
  (``hints.limits``).
* ``dtkv.prefetch``: a request naming a session (``scope``) this tier retained chunks for
  queues ``TieredStore.prefetch`` of those chunks in token order, cut to the hint's
  ``[start, end)`` in whole chunks, into the SSD tier: chunks only the object tier holds come
  up to the SSD while the request waits for its lookups and loads. It runs when vLLM announces
  the request, before any of its chunks is keyed, so the session is found by its scope alone
  (the most recently used session of that name): a client that names another tenant's session
  can make the tier promote that session's chunks (never read, retain or release them), at most
  ``MAX_PREFETCH_ACTIONS`` sessions per request. What the store guarantees for it: the call
  only queues (bounded queue, 64 jobs; past that the hint is dropped and counted); a job takes
  a staging slab only when one is free at that moment and yields to the loop between batches,
  so loads a request waits on get the slabs first; it stops rather than take room held by
  protected blocks (``prefetch_stats.stopped_protected``); it promotes the leading chunks
  present somewhere below the SSD and stops at the first chunk no tier holds. No SSD tier
  (objects alone): nothing to promote into; counted.
* ``kv.fetch``: counted, not acted on (``hints/prefetch.py`` says why).
* Session end (``hints.sessions.ends_session``): ``X-Dynamo-Session-Final`` in
  ``kv_transfer_params`` (Dynamo forwards it there), or a retain at priority 0 over the whole
  request: when it finishes, its holder's claims on its chunks and on those retained under its
  session (earlier turns) are released and the chunks demoted (a chunk another holder still
  protects keeps its place).

What was done with each accepted prefetch or fetch action is counted in ``HintStats.applied``
(``dtkv_hint_applied_total{action,result}``). Everything runs on vLLM's scheduler thread and
never blocks on I/O: ``retain`` only updates the retention tables, ``prefetch`` and ``demote``
queue work on the store's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...blocks.keys import BlockKey
from ...hints import FETCH_ACTION, PREFETCH_ACTION, BlockRetention, HintStats, RequestHints, read_hints
from ...hints.limits import MAX_REQUEST_BLOCKS
from ...hints.sessions import DEFAULT_TENANT, Holder, RetentionCursor, SessionScopes, ends_session, holder
from ...store import TieredStore
from ..common.session_flags import session_final

log = logging.getLogger(__name__)


@dataclass
class SessionHints:
    """Per-request state (``ReqContext.get_state(SessionHints)``)."""

    hints: RequestHints | None
    final: bool
    keys: dict[BlockKey, None] = field(default_factory=dict)  # chunks seen, in order (bounded)
    owner: Holder | None = None  # who holds its retention, fixed at its first keyed chunk
    plan: RetentionCursor | None = None  # its kv.retain plan, made at its first keyed chunk
    retained: set[BlockKey] = field(default_factory=set)  # chunks already given their retention


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
    positions = _positions(req_context)
    return max(int(p) for p in positions.values()) if positions else None


def _positions(req_context: Any) -> Mapping[Any, int] | None:
    positions = getattr(req_context, "_offload_key_positions", None)
    return positions if isinstance(positions, Mapping) else None


def request_tenant(req_context: Any) -> str:
    """The tier's view of the request's tenant: a digest of its first chunk's key, the key vLLM
    recorded at the lowest position (module docstring); the default tenant if vLLM's table of
    positions cannot be read (then the sessions of one scope name share a holder)."""
    positions = _positions(req_context)
    if not positions:
        return DEFAULT_TENANT
    first = min(positions.items(), key=lambda kv: (int(kv[1]), bytes(kv[0])))[0]
    return bytes(first).hex()[:16]


class HintApplier:
    """Applies one tier's requests' hints to its store (module docstring)."""

    def __init__(self, store: TieredStore, chunk_tokens: int | None, stats: HintStats | None = None) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens  # None: positions cannot be mapped (no vLLM spec): retain is off
        self.stats = stats or HintStats()
        # the tier a prefetch promotes into: the SSD (None: objects alone, nothing to promote into)
        self.prefetch_into = next((i for i, t in enumerate(store.tiers) if t.capabilities.medium == "ssd"), None)
        self.scopes: SessionScopes[BlockKey] = SessionScopes()

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
        room = MAX_REQUEST_BLOCKS - len(st.keys)
        if room > 0:
            st.keys.update(dict.fromkeys(bks[:room]))
        retain = st.hints.retain if st.hints is not None else None
        if retain is None or self.chunk_tokens is None:
            return
        if st.owner is None:
            st.owner = holder(request_tenant(req_context), retain)
            st.plan = RetentionCursor(retain, block_size=self.chunk_tokens, prompt_tokens=prompt_tokens(req_context),
                                      now=self.store.retention.clock())
        got: list[tuple[BlockKey, BlockRetention, int]] = []
        for key, bk in zip(keys, bks):
            if bk in st.retained:
                continue  # planned once per chunk and request
            end = req_context.get_offload_key_position(key)
            if end is None or end < self.chunk_tokens:
                continue
            index = end // self.chunk_tokens - 1
            level = st.plan.at(index)  # type: ignore[union-attr]
            if len(st.retained) < MAX_REQUEST_BLOCKS:
                st.retained.add(bk)
            if level is not None:
                got.append((bk, level, index))
        if got:
            self.store.retain([k for k, _, _ in got], [r for _, r, _ in got], holder=st.owner)
            self.scopes.remember(st.owner, ((i, k) for k, _, i in got))

    def _prefetch(self, hints: RequestHints) -> None:
        """Queue the promotion of each named session's retained chunks (module docstring)."""
        for p in hints.prefetch:
            owner = self.scopes.latest(p.scope)
            if owner is None or self.chunk_tokens is None:
                self.stats.applied(PREFETCH_ACTION, "unknown_scope")
                continue
            if self.prefetch_into is None:
                self.stats.applied(PREFETCH_ACTION, "no_target")
                continue
            # whole chunks from the one holding ``start``; past ``end`` a chunk's hash covers tokens
            # the next turn need not share, so a chunk that ends after ``end`` is left out
            wanted = self.scopes.span(owner, p.start // self.chunk_tokens,
                                      None if p.end is None else p.end // self.chunk_tokens)
            if not wanted:
                self.stats.applied(PREFETCH_ACTION, "empty_range")
                continue
            self.store.prefetch(wanted, into=self.prefetch_into)
            self.stats.applied(PREFETCH_ACTION, "queued")

    def on_request_finished(self, req_context: Any) -> None:
        st = req_context.get_state(SessionHints)
        if st is None or not ends_session(st.final, st.hints):
            return
        owner = st.owner or holder(request_tenant(req_context), st.hints.retain if st.hints is not None else None)
        keys = dict(st.keys)
        keys.update(dict.fromkeys(self.scopes.forget(owner)))
        if keys:
            self.store.demote(list(keys), holder=owner, wait=False)
