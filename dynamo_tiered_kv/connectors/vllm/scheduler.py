"""Scheduler role: how many prompt tokens the store can restore, and which blocks to move.

Loads are asynchronous by default (``load_async``): ``get_num_new_matched_tokens`` returns
``(n, True)``, vLLM allocates the blocks and parks the request in ``WAITING_FOR_REMOTE_KVS`` while
the workers restore in the background (``onboard``) and the rest of the batch keeps running; each
worker reports the restore through ``get_finished`` and its failed blocks in the same step. vLLM
then rolls the request back to its first failed block, caches only the blocks before it (so no
other request can take a prefix hit on an async load's blocks before its outcome is known) and
schedules it. This role accumulates the failed blocks of every load in flight across steps (TP
ranks may finish in different steps), moves ``saved`` back to the first failed block so the
recomputed blocks are stored, and never offers that request a load at or past it again (a
failure with nothing valid frees the blocks and vLLM asks again). A request aborted while its
restore runs keeps its blocks until every worker reported it (vLLM's ``finish_requests`` delays
the free of a ``WAITING_FOR_REMOTE_KVS`` request), so ``request_finished`` never has to.

A small restore on an idle engine (``sync_restore_max_tokens``) is synchronous even with
``load_async``: nothing else runs meanwhile, and the request computes in the step that restores it
instead of two steps later. With ``load_async=False`` every load is synchronous: vLLM runs
``start_load_kv`` before the step's forward, and a failed block is reported through
``get_block_ids_with_load_errors`` so vLLM recomputes from it on. Saves are whole blocks that
become full during a step; the worker copies them into staging inside that step's
``wait_for_save``, so by the time a request finishes its blocks are already out of the engine and
``request_finished`` never has to hold them.

A request saves nothing while a block it computes over has an unknown load outcome (its own
load, or another request's synchronous load it took a local prefix hit on, possibly in an earlier
step whose output is not back yet: see ``load_outcomes``). A block that failed to load holds
garbage, and so does everything computed over it (on every TP rank, through the all-reduce). Once
every outcome is known: all loaded, saves resume where they stopped; a failure and vLLM rolled the
request back to where its held computation began (or earlier), saves resume from the rolled-back
``num_computed_tokens``, so the recomputed blocks are stored; a failure and vLLM kept KV computed
over the failed block (it rolls back only one request per shared block), the request never saves
again.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from ...blocks.keys import ROOT_KEY, Namespace, block_key, scope_salt
from ...blocks.tenant import DEFAULT_TENANT as NO_TENANT
from ...blocks.tenant import tenant_hex, tenant_id
from ...config import TieredKVConfig
from ...hints import HintStats, RequestHints, read_hints
from ...hints.limits import MAX_REQUEST_BLOCKS
from ...hints.sessions import DEFAULT_TENANT, Holder, RetentionCursor, SessionScopes, ends_session, holder
from ...hints.stats import HintCounts
from ..common.identity import lora_scopes
from ..common.session_flags import session_final
from .load_outcomes import LoadOutcomes
from .metadata import LoadSpec, RetainSpec, SaveSpec, StepEcho, TieredKVMetadata
from .rendezvous import LookupClient
from .session_retain import note_fetch, plan_spec, prefetch_specs, retention_cursor

log = logging.getLogger(__name__)


def token_namespace(model_id: str, block_size: int, tenant_salt: str) -> Namespace:
    """Namespace of the layout-independent token hashes the scheduler computes."""
    return Namespace(model_id, "tokens", "tokens", block_size, 1, 1, 1, tenant_salt=tenant_salt)


@dataclass
class _Req:
    request: Any  # vllm.v1.request.Request (live object: its token list grows)
    ns: Namespace | None  # None: not cacheable (multimodal, prompt embeddings)
    tenant: bytes = NO_TENANT  # its tenant (``blocks.tenant``: a keyed digest of its cache_salt)
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_local: int = 0  # tokens the engine's own prefix cache had
    saved: int = 0  # blocks [0, saved) are stored, loaded or deliberately skipped
    pending_load: LoadSpec | None = None
    #: num_computed_tokens when its saves were first held on an unknown load outcome
    held_from: int | None = None
    #: kept KV computed over a block that failed to load: never save again
    tainted: bool = False
    load_first: int = 0  # block index of the first block of its last load
    loading: bool = False  # an asynchronous load is in flight
    load_async: bool = False  # how its pending load runs (``SchedulerRole.restore_is_async``)
    #: an asynchronous load failed at this block index: never offer a load reaching it again
    load_cap: int | None = None
    hints: RequestHints | None = None  # its KV hints (``session_retain``), read once
    final: bool = False  # its session's last request (``X-Dynamo-Session-Final``)
    retain_planned: bool = False
    retention: RetentionCursor | None = None  # its kv.retain plan, once planned
    retain_upto: int = 0  # blocks [0, retain_upto) have had their kv.retain planned

    @property
    def holder(self) -> Holder:
        """Who holds this request's retention: its tenant (hex) and ``kv.retain`` scope."""
        tenant = tenant_hex(self.tenant) if self.ns is not None else DEFAULT_TENANT
        return holder(tenant, self.hints.retain if self.hints is not None else None)

    def hashes_upto(self, n: int) -> list[bytes]:
        tokens = self.request.all_token_ids
        bs = self.ns.block_size  # type: ignore[union-attr]
        while len(self.hashes) < n:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else ROOT_KEY
            self.hashes.append(block_key(self.ns, parent, tokens[i * bs:(i + 1) * bs]))  # type: ignore[arg-type]
        return self.hashes[:n]


@dataclass
class _AsyncLoad:
    block_ids: list[int]
    first: int  # block index of block_ids[0] in the request
    failed: set[int] = field(default_factory=set)  # reported so far, by any worker


class SchedulerRole:
    def __init__(self, config: TieredKVConfig, *, model_id: str, block_size: int, lookup: LookupClient,
                 kv_events: bool = False) -> None:
        self.config = config
        self.block_size = block_size
        self.model_id = model_id  # connector.model_identity, the worker's too: their namespaces must agree
        self._salt = config.tenant_salt.get_secret_value()
        self._epoch = ""  # new random value on every reset_cache (weights changed): old keys unreachable
        self._lookup = lookup
        self._reqs: dict[str, _Req] = {}
        self.min_prefix_blocks = config.min_prefix_blocks
        self.kv_events = kv_events
        self._events: list[Any] = []  # engine-wide events not yet taken (ResidencyLedger output)
        self._ledger: Any = None  # events.ResidencyLedger, created with the first events
        self._outcomes = LoadOutcomes()  # scheduler thread only, like every hook of this role
        self._step = 0  # number of the last step built (TieredKVMetadata.step)
        self._reset_pending = False
        self.load_async = config.load_async
        # larger restores, or any under load, stay asynchronous: a request arriving meanwhile waits
        # at most one synchronous restore (restore_is_async)
        self.sync_restore_max_tokens = config.sync_restore_max_tokens
        self._async: dict[str, _AsyncLoad] = {}  # asynchronous loads not yet reported finished
        self._orphans: list[LoadSpec] = []  # async loads of requests finished before they were sent
        self.hint_stats = HintStats()
        self._hints_sent = HintCounts()  # hint_stats as of the last step that carried its growth
        self._hints_seen = 0  # hint_stats.changes when _send_hint_counts last took counts()
        self._retains: list[RetainSpec] = []  # KV hints for the workers, sent with the next step
        self._scopes: SessionScopes[bytes] = SessionScopes()  # retained sessions' blocks, per tenant

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _Req(request, self._namespace_for(request),
                      tenant_id(getattr(request, "cache_salt", None), deployment_salt=self._salt))
            if st.ns is not None:
                st.hints = read_hints(request, stats=self.hint_stats)  # never raises
                st.final = session_final(getattr(request, "kv_transfer_params", None))
            self._reqs[request.request_id] = st
        else:
            st.request = request
        return st

    def _namespace_for(self, request: Any) -> Namespace | None:
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None  # token ids do not identify multimodal or embedding prompts
        salt = scope_salt(self._salt, cache=getattr(request, "cache_salt", None), epoch=self._epoch,
                          **lora_scopes(getattr(request, "lora_request", None)))
        return token_namespace(self.model_id, self.block_size, salt)

    # --- vLLM hooks -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        if st.ns is None or st.loading:
            return 0, False
        bs = self.block_size
        n_full = (request.num_tokens - 1) // bs  # vLLM must compute at least the last token
        if st.load_cap is not None:
            n_full = min(n_full, st.load_cap)
        first = num_computed_tokens // bs
        if not st.retain_planned:
            self._plan_retention(st, request)
        if n_full <= first:
            return 0, False
        hashes = st.hashes_upto(n_full)
        n_hit, _tiers = self._lookup.lookup(hashes[first:])
        matched = n_hit * bs
        st.num_local = num_computed_tokens
        if matched <= 0:
            return 0, False
        st.load_async = self.restore_is_async(request.request_id, matched)
        return matched, st.load_async

    def _plan_retention(self, st: _Req, request: Any) -> None:
        """The request's kv.retain over its prompt's full blocks, for the workers (once)."""
        st.retain_planned = True
        if st.hints is None:
            return
        self._retains += prefetch_specs(self._scopes, st.holder[0], st.hints, self.block_size, self.hint_stats)
        note_fetch(st.hints, self.hint_stats)
        prompt = int(getattr(request, "num_prompt_tokens", request.num_tokens))
        st.retention = retention_cursor(st.hints, block_size=self.block_size, prompt_tokens=prompt)
        if st.retention is None:
            return
        st.retain_upto = prompt // self.block_size
        spec = plan_spec(st.retention, st.hashes_upto(st.retain_upto), st.holder)
        if spec is not None:
            self._retains.append(spec)

    def _plan_saved_retention(self, st: _Req, full: int) -> None:
        """kv.retain of blocks saved past those planned: generated tokens (``covers_output``)."""
        if st.retention is None or full <= st.retain_upto:
            return
        spec = plan_spec(st.retention, st.hashes_upto(full), st.holder, first=st.retain_upto)
        st.retain_upto = full
        if spec is not None:
            self._retains.append(spec)

    def restore_is_async(self, req_id: str, tokens: int) -> bool:
        """Asynchronous unless ``load_async`` is off, or the restore is small (at most
        ``sync_restore_max_tokens``) and the engine idle: no other request alive (running,
        waiting or preempted) and no asynchronous restore in flight."""
        if not self.load_async:
            return False
        idle = not self._async and not self._orphans and all(r == req_id for r in self._reqs)
        return not (idle and tokens <= self.sync_restore_max_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._state(request)
        bs = self.block_size
        local_blocks = st.num_local // bs
        ext_blocks = num_external_tokens // bs
        if ext_blocks > 0 and st.ns is not None:
            ids = list(blocks.get_block_ids()[0])
            st.pending_load = LoadSpec(request.request_id, ids[local_blocks:local_blocks + ext_blocks],
                                       st.hashes[local_blocks:local_blocks + ext_blocks], is_async=st.load_async)
            st.load_first = local_blocks
            st.loading = st.load_async
        # Blocks the engine already had or is about to load are stored: never save them again.
        st.saved = max(st.saved, local_blocks + ext_blocks)

    def build_connector_meta(self, scheduler_output: Any) -> TieredKVMetadata:
        self._step += 1
        meta = TieredKVMetadata(reset_cache=self._reset_pending,
                                idle=not any(scheduler_output.num_scheduled_tokens.values()), step=self._step)
        self._reset_pending = False
        loading: list[int] = []  # engine blocks restored synchronously in this step
        meta.loads, self._orphans = self._orphans, []
        meta.retains, self._retains = self._retains, []
        for st in self._reqs.values():
            spec = st.pending_load
            if spec is None:
                continue
            meta.loads.append(spec)
            st.pending_load = None
            if spec.is_async:
                # Outcome unknown until every worker reported it (update_connector_output).
                self._outcomes.started(spec.block_ids)
                self._async[spec.req_id] = _AsyncLoad(list(spec.block_ids), st.load_first)
            else:
                loading.extend(spec.block_ids)
        self._outcomes.step_built(self._step, loading)
        computed: dict[str, int] = {}
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is not None:
                st.block_ids = list(nr.block_ids[0])
                computed[nr.req_id] = nr.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = _resumed_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        bs = self.block_size
        for req_id, n_computed in computed.items():
            st = self._reqs[req_id]
            if st.ns is None:
                continue
            n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not self._may_save(req_id, st, n_computed):
                continue
            n_after = n_computed + n_sched
            full = min(n_after, st.request.num_tokens) // bs
            full = min(full, len(st.block_ids))
            if full <= st.saved or full < self.min_prefix_blocks:
                continue
            start = st.saved
            hashes = st.hashes_upto(full)
            spec = SaveSpec(req_id, st.block_ids[start:full], hashes[max(0, start - 1):full], start, tenant=st.tenant)
            if self.kv_events:
                spec.token_ids = list(st.request.all_token_ids[start * bs:full * bs])
                lora = getattr(st.request, "lora_request", None)
                if lora is not None:
                    spec.lora_id = getattr(lora, "lora_int_id", None)
                    spec.lora_name = getattr(lora, "lora_name", None)
            meta.saves.append(spec)
            st.saved = full
            self._plan_saved_retention(st, full)
        meta.retains += self._retains  # those planned with this step's saves
        self._retains = []
        self._send_hint_counts(meta)
        return meta

    def _send_hint_counts(self, meta: TieredKVMetadata) -> None:
        """Attach what ``hint_stats`` gained since the last step that carried any: this role has no
        store and no /metrics, so the workers export the counters. Every step's metadata reaches
        every worker, so nothing sent is lost; what is counted after the last step waits for
        the next one. A step with no change since the last look takes no copy (most steps)."""
        changes = self.hint_stats.changes
        if changes == self._hints_seen:
            return
        # read before the copy: a count made between the two is in the copy and moves ``changes``
        # past this reading, so the next step looks again and finds nothing new, never a loss
        self._hints_seen = changes
        now = self.hint_stats.counts()
        grown = now.since(self._hints_sent)
        if grown:
            meta.hint_counts = grown
            self._hints_sent = now

    def _may_save(self, req_id: str, st: _Req, n_computed: int) -> bool:
        """Whether ``st`` may save this step; on a settled failure, moves ``saved`` back."""
        if st.tainted:
            return False
        self._outcomes.touch(req_id, st.block_ids)
        failed = self._outcomes.settle(req_id)
        if failed is None:  # computes over blocks whose load outcome is unknown
            if st.held_from is None:
                st.held_from = n_computed
            return False
        held_from, st.held_from = st.held_from, None
        if not failed:
            return True  # every block it computed over loaded: what it computed meanwhile is sound
        if held_from is not None and n_computed <= held_from:
            # vLLM rolled it back past everything computed while held: that is recomputed now.
            st.saved = min(st.saved, n_computed // self.block_size)
            return True
        log.info("request %s keeps KV computed over blocks that failed to load; it saves nothing more",
                 req_id)
        st.tainted = True
        return False

    def update_connector_output(self, connector_output: Any) -> None:
        # The workers name the step this output is for (StepEcho): its load outcome is now known.
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        echo = getattr(connector_output, "kv_connector_worker_meta", None)
        self._outcomes.step_output(invalid, echo.step if isinstance(echo, StepEcho) else None)
        if self._async:
            self._async_outcomes(invalid, getattr(connector_output, "finished_recving", None) or ())
        events = getattr(connector_output, "kv_cache_events", None)
        if not self.kv_events or events is None or type(events).__name__ != "TieredKVEvents":
            return
        if self._ledger is None:
            from .events import ResidencyLedger

            self._ledger = ResidencyLedger()
        self._events.extend(self._ledger.apply(events.get_all_events(), getattr(events, "world", 1)))

    def _async_outcomes(self, invalid: set[int], finished: Any) -> None:
        """Failed blocks of async loads (any step up to their finish) and loads every worker finished.

        An async load's blocks belong to its waiting request until vLLM sees it finished (even if
        aborted), so an invalid id among them is theirs.
        """
        if invalid:
            for ld in self._async.values():
                ld.failed.update(invalid.intersection(ld.block_ids))
        for req_id in finished:
            ld = self._async.pop(req_id, None)
            if ld is None:
                continue
            self._outcomes.finished(ld.block_ids, ld.failed)
            st = self._reqs.get(req_id)
            if st is None:
                continue  # finished (aborted) while loading; vLLM frees its blocks now
            st.loading = False
            if ld.failed:
                # vLLM rolls it back to this block and recomputes from it: store what it recomputes.
                cut = ld.first + min(ld.block_ids.index(b) for b in ld.failed)
                st.saved = min(st.saved, cut)
                st.load_cap = cut if st.load_cap is None else min(st.load_cap, cut)
                log.info("request %s: %d of %d restored blocks failed; vLLM recomputes from block %d",
                         req_id, len(ld.failed), len(ld.block_ids), cut)

    def take_events(self) -> list[Any]:
        """Tier events since the last call: BlockStored once every worker (TP x PP rank) holds a
        block in that tier, BlockRemoved once any of them dropped it (``events.ResidencyLedger``)."""
        out, self._events = self._events, []
        return out

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves were copied to staging inside the steps that computed them, and vLLM itself keeps
        # the blocks of a request aborted while its async load runs (see module docstring).
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.pending_load is not None and st.pending_load.is_async:
            self._orphans.append(st.pending_load)  # vLLM waits for its finished_recving: send it anyway
            self._outcomes.started(st.pending_load.block_ids)
            self._async[request.request_id] = _AsyncLoad(list(st.pending_load.block_ids), st.load_first)
        self._outcomes.forget(request.request_id)
        if st is not None and st.hashes and ends_session(st.final, st.hints):
            owner = st.holder  # the session is over: release what it held, earlier turns included
            done = dict.fromkeys(self._scopes.forget(owner))
            done.update(dict.fromkeys(st.hashes[:MAX_REQUEST_BLOCKS]))
            self._retains.append(RetainSpec(list(done), demote=True, holder=owner))
        elif st is not None:
            self._scopes.remember(st.holder, enumerate(st.hashes), replace=True)
        return False, None

    def reset_cache(self) -> bool:
        """The weights changed (``reset_prefix_cache(reset_connector=True)``): never serve old KV.

        A new random epoch enters every later key, so nothing stored before can match again, on
        this node or any other. Requests alive across the reset neither load nor save any more
        (their KV may mix old and new weights). The next step tells the workers to drop their
        host and SSD blocks; the shared object tier's old keys expire by TTL and GC.

        vLLM also resets connectors on every pause/sleep with ``clear_cache`` (sleep level >= 1),
        where the weights usually stay the same; it cannot tell us which, so the safe answer is the
        default, and ``cache_reset: keep`` is for deployments whose weights never change in place.
        """
        if self.config.cache_reset == "keep":
            log.info("TieredKVConnector: cache reset ignored (cache_reset: keep); stored KV stays in use")
            return True
        self._epoch = secrets.token_hex(16)
        for st in self._reqs.values():
            st.ns = None  # (async loads still running report every block failed: see onboard.reset)
        self._reset_pending = True
        log.info("TieredKVConnector: cache reset; stored KV of the previous weights is no longer used")
        return True

    def shutdown(self) -> None:
        self._lookup.close()


def _resumed_ids(cached: Any) -> set[str]:
    """Requests resumed from preemption (their block list is replaced, not extended).

    0.32 has ``resumed_req_ids``; older releases a per-request ``resumed_from_preemption`` list.
    """
    ids = getattr(cached, "resumed_req_ids", None)
    if ids is not None:
        return set(ids)
    flags = getattr(cached, "resumed_from_preemption", None) or []
    return {r for r, f in zip(cached.req_ids, flags, strict=False) if f}


def with_recompute_policy(kv_transfer_config: Any) -> None:
    """A cache miss must never fail a request: make vLLM recompute blocks that failed to load."""
    if getattr(kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
        try:
            kv_transfer_config.kv_load_failure_policy = "recompute"
            log.info("TieredKVConnector: kv_load_failure_policy set to 'recompute' (a failed load is a miss)")
        except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
            log.warning("set kv_load_failure_policy='recompute' in --kv-transfer-config: with 'fail', a "
                        "corrupt or missing stored block fails the request instead of being recomputed")
