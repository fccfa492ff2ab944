"""Our vLLM connector keeps one holder's retention from another's: a request raises the
retention others gave a block, never lowers or releases it; a prefetch names sessions of its own
tenant only; random hostile envelopes stay within the per-request bounds (``hints.limits``)."""

from __future__ import annotations

import random
from typing import Any

from test_connector_hints import HintedRequest, _roles
from test_connector_scheduler import BS, sched_output

from dynamo_tiered_kv.connectors.vllm.metadata import SaveSpec, TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole
from dynamo_tiered_kv.hints import PREFETCH_ACTION
from dynamo_tiered_kv.hints.limits import MAX_PREFETCH_ACTIONS

PROMPT = list(range(4 * BS + 3))


def _envelope(*actions: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"protocol_version": "1.0", "message_id": "m", "actions": [
        {"action_id": f"a{i}", "action_type": t, "action_version": "1.0", "payload": p}
        for i, (t, p) in enumerate(actions)]}


def _retain(scope: str | None, *directives: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "kv.retain", {"scope": scope, "directives": list(directives)}


def _turn(sched: SchedulerRole, w: WorkerRole, req: HintedRequest) -> TieredKVMetadata:
    """One request through the scheduler's hooks and the worker's step, then finished."""
    sched.get_num_new_matched_tokens(req, 0)
    meta = sched.build_connector_meta(sched_output({}))
    w.start_load_kv(meta)
    sched.request_finished(req, [])
    w.start_load_kv(sched.build_connector_meta(sched_output({})))  # a session end's release
    return meta


def _protected(sched: SchedulerRole, w: WorkerRole, salt: str | None, scope: str) -> list[bytes]:
    """A request of tenant ``salt`` keeps its prompt's four blocks at priority 100 for an hour."""
    req = HintedRequest(f"keep-{salt}-{scope}", PROMPT, cache_salt=salt,
                        kv_transfer_params={"kv_hints": _envelope(_retain(scope, {"priority": 100, "duration": 3600}))})
    sched.get_num_new_matched_tokens(req, 0)
    hashes = sched._reqs[req.request_id].hashes_upto(4)
    w.start_load_kv(sched.build_connector_meta(sched_output({})))
    sched.request_finished(req, [])
    return w.keys_of(hashes)


def test_another_session_can_raise_a_blocks_retention_but_never_lower_it(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        keys = _protected(sched, w, None, "chat")
        host = w.store.retention.retention_of(0)
        for i, (scope, directive) in enumerate((("other", {"priority": 1, "duration": 1}), ("other", {"priority": 0}),
                                                (None, {"priority": 1, "duration": 0}))):
            req = HintedRequest(f"low{i}", PROMPT, kv_transfer_params={
                "kv_hints": _envelope(_retain(scope, directive)), "X-Dynamo-Session-Final": True})
            _turn(sched, w, req)
            assert [host.priority(k) for k in keys] == [100] * 4, (scope, directive)
        # the session itself may release what it holds
        _turn(sched, w, HintedRequest("own", PROMPT, kv_transfer_params={
            "kv_hints": _envelope(_retain("chat", {"priority": 0})), "X-Dynamo-Session-Final": True}))
        assert [host.priority(k) for k in keys] == [0] * 4
    finally:
        w.shutdown()


def test_a_prefetch_never_names_another_tenants_session(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        _protected(sched, w, "tenant-a", "chat")
        probe = HintedRequest("b", list(range(3)), cache_salt="tenant-b",
                              kv_transfer_params={"kv_hints": _envelope(("dtkv.prefetch", {"scope": "chat"}))})
        meta = _turn(sched, w, probe)
        assert not [s for s in meta.retains if s.prefetch]
        assert sched.hint_stats.applications(PREFETCH_ACTION, "unknown_scope") == 1
        own = HintedRequest("a", list(range(3)), cache_salt="tenant-a",
                            kv_transfer_params={"kv_hints": _envelope(("dtkv.prefetch", {"scope": "chat"}))})
        meta = _turn(sched, w, own)
        assert [len(s.token_hashes) for s in meta.retains if s.prefetch] == [4]
    finally:
        w.shutdown()


def test_random_hostile_envelopes_stay_bounded_and_never_lower_others(tmp_path) -> None:
    """Property: hostile envelopes (hundreds of directives, huge scopes, prefetch floods, session
    ends, other tenants and the victim's own tenant) never lower the victim session's blocks and
    send at most one retention per block and ``MAX_PREFETCH_ACTIONS`` prefetches per request."""
    rng = random.Random(11)
    sched, w = _roles(tmp_path)
    try:
        keys = _protected(sched, w, None, "vault")
        host = w.store.retention.retention_of(0)
        for r in range(30):
            n_dir = rng.choice([0, 1, 128, 500])
            prios = sorted((rng.randint(0, 100) for _ in range(n_dir)), reverse=True)
            scope = rng.choice(["chat", None, "z" * rng.choice([10, 300, 100_000])])
            actions = [_retain(scope, *({"start": i * BS, "priority": p, "duration": rng.choice([0, 1, None])}
                                        for i, p in enumerate(prios)))]
            actions += [("dtkv.prefetch", {"scope": rng.choice(["chat", "vault"])})] * rng.choice([0, 5, 300])
            tokens = PROMPT[:rng.randint(1, len(PROMPT))] + [rng.randint(0, 99) for _ in range(rng.randint(0, 40))]
            req = HintedRequest(f"h{r}", tokens, cache_salt=rng.choice([None, "other-tenant"]),
                                kv_transfer_params={"kv_hints": _envelope(*actions),
                                                    "X-Dynamo-Session-Final": rng.random() < 0.5})
            sched.get_num_new_matched_tokens(req, 0)
            st = sched._reqs[req.request_id]
            full = len(tokens) // BS
            meta = sched.build_connector_meta(sched_output({}))
            w.start_load_kv(meta)
            saved = min(full, 8)  # the engine's KV holds 8 blocks
            if saved:  # it saves its blocks, then finishes
                hashes = st.hashes_upto(saved)
                w.wait_for_save(TieredKVMetadata(saves=[SaveSpec(req.request_id, list(range(saved)), hashes, 0)]))
            sched.request_finished(req, [])
            end = sched.build_connector_meta(sched_output({}))
            w.start_load_kv(end)
            planned = sum(len(s.token_hashes) for s in meta.retains + end.retains if not s.prefetch and not s.demote)
            assert planned <= full
            assert sum(1 for s in meta.retains if s.prefetch) <= MAX_PREFETCH_ACTIONS
            assert st.retention is None or st.retention.plans <= 2
            assert [host.priority(k) for k in keys] == [100] * 4, f"round {r} lowered the victim's retention"
    finally:
        w.shutdown()
