"""Hints are untrusted input in the vLLM secondary tier: a request's retention is planned a
bounded number of times and applied once per chunk, its prefetch actions are capped, its scope
is bounded, and no request can lower or release the retention another holder (another session,
another tenant) gave a chunk. Real vLLM 0.33 tiering manager, real SSD tier."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tiering_engine import Engine, keys
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from dynamo_tiered_kv.connectors.vllm_tiering.key_mapping import block_keys
from dynamo_tiered_kv.connectors.vllm_tiering.session_hints import SessionHints
from dynamo_tiered_kv.hints import PREFETCH_ACTION
from dynamo_tiered_kv.hints.limits import MAX_PREFETCH_ACTIONS, MAX_SCOPE_CHARS


def _settings(tmp_path: Path) -> dict[str, object]:
    return {"ssd_dir": str(tmp_path / "ssd"), "ssd_segment_bytes": 1 << 20, "ssd_capacity_bytes": 64 << 20,
            "staging_slab_bytes": 256 << 10, "staging_slabs": 4}


def _envelope(*actions: tuple[str, dict[str, Any]]) -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version="1.0", message_id="m", actions=[
        KvHintAction(action_id=f"a{i}", action_type=kind, action_version="1.0", payload=payload)
        for i, (kind, payload) in enumerate(actions)])


def _retain(scope: str | None, *directives: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "kv.retain", {"scope": scope, "directives": list(directives)}


class _Counted:
    """Counts the keys passed to one store method (the real method still runs)."""

    def __init__(self, target: Any, name: str) -> None:
        self.calls = 0
        self.keys = 0
        real: Callable[..., Any] = getattr(target, name)

        def counted(ks: Any, *a: Any, **kw: Any) -> Any:
            self.calls += 1
            self.keys += len(ks)
            return real(ks, *a, **kw)

        setattr(target, name, counted)


@pytest.fixture
def eng(tmp_path: Path) -> Iterator[Engine]:
    e = Engine.start(_settings(tmp_path))
    try:
        yield e
    finally:
        e.stop()


def _request(eng: Engine, req_id: str, hints: KvHintsEnvelope | None, ks: list[OffloadKey],
             params: dict[str, Any] | None = None) -> ReqContext:
    """A request whose prompt's chunks are ``ks``, keyed as vLLM keys a prompt at admission."""
    ctx = eng.new_request(ReqContext(req_id=req_id, kv_hints=hints, kv_transfer_params=params))
    chunk = eng.tier._hints.chunk_tokens
    for i, k in enumerate(ks):
        ctx.set_offload_key_position(k, (i + 1) * chunk)
    return ctx


def _lookup_each(eng: Engine, ctx: ReqContext, ks: list[OffloadKey]) -> None:
    """vLLM's scheduler asks the tier one chunk at a time, under the manager's lock."""
    with eng.manager.lock:
        for k in ks:
            eng.tier.lookup(k, ctx)


def _finish(eng: Engine, ctx: ReqContext) -> None:
    with eng.manager.lock:
        eng.tier.on_request_finished(ctx)


def test_a_long_request_is_planned_a_few_times_and_each_chunk_retained_once(eng: Engine) -> None:
    chunk = eng.tier._hints.chunk_tokens
    n = 2048  # a 32k-token prompt in vLLM 0.33's default 16-token chunks
    directives = [{"start": i * 16 * chunk, "end": (i + 1) * 16 * chunk, "priority": 100 - i // 2, "duration": 3600}
                  for i in range(128)]
    ks = keys(n, tag="long")
    ctx = _request(eng, "long", _envelope(_retain("s", *directives)), ks)
    retains = _Counted(eng.tier.store, "retain")
    for _ in range(3):  # vLLM looks a waiting request up again on later steps
        _lookup_each(eng, ctx, ks)
    st = ctx.get_state(SessionHints)
    assert st is not None and st.plan is not None
    assert st.plan.plans <= 2
    assert retains.keys == n  # each chunk given its retention once, not once per lookup pass
    cls = eng.tier.store.retention.retention_of(0)
    bks = block_keys(eng.tier.namespace, ks)
    assert cls.priority(bks[0]) == 100 and cls.priority(bks[-1]) == 100 - 127 // 2


def test_prefetch_actions_past_the_cap_queue_nothing(eng: Engine) -> None:
    ks = keys(8, tag="p")
    turn = _request(eng, "t1", _envelope(_retain("chat", {"priority": 60, "duration": 3600})), ks)
    _lookup_each(eng, turn, ks)
    _finish(eng, turn)
    prefetches = _Counted(eng.tier.store, "prefetch")
    flood = _envelope(*[("dtkv.prefetch", {"scope": "chat"}) for _ in range(256)])
    _request(eng, "t2", flood, ks)
    assert prefetches.calls == MAX_PREFETCH_ACTIONS
    assert eng.tier._hints.stats.applications(PREFETCH_ACTION, "queued") == MAX_PREFETCH_ACTIONS
    assert eng.tier._hints.stats.actions(PREFETCH_ACTION, "dropped") == 256 - MAX_PREFETCH_ACTIONS


def test_a_huge_scope_is_rejected_and_remembers_nothing(eng: Engine) -> None:
    ks = keys(4, tag="h")
    for i in range(16):
        ctx = _request(eng, f"h{i}", _envelope(_retain("x" * (1 << 20), {"priority": 60})), ks)
        _lookup_each(eng, ctx, ks)
        _finish(eng, ctx)
    assert len(eng.tier._hints.scopes) == 0
    assert eng.tier._hints.stats.rejections("kv.retain", "scope") == 16
    ok = _request(eng, "ok", _envelope(_retain("y" * MAX_SCOPE_CHARS, {"priority": 60})), ks)
    _lookup_each(eng, ok, ks)
    assert len(eng.tier._hints.scopes) == 1


def _protect(eng: Engine, ks: list[OffloadKey], scope: str = "chat") -> None:
    ctx = _request(eng, f"keep-{scope}", _envelope(_retain(scope, {"priority": 100, "duration": 3600})), ks)
    _lookup_each(eng, ctx, ks)
    _finish(eng, ctx)


def test_another_tenants_session_end_releases_nothing_of_ours(eng: Engine) -> None:
    ours, theirs = keys(4, tag="tenant-a"), keys(4, tag="tenant-b")  # other salts: other chunk keys
    _protect(eng, ours)
    cls = eng.tier.store.retention.retention_of(0)
    bks = block_keys(eng.tier.namespace, ours)
    end = _request(eng, "b-final", _envelope(_retain("chat", {"priority": 0})), theirs,
                   params={"X-Dynamo-Session-Final": True})
    _lookup_each(eng, end, theirs)
    _finish(eng, end)
    assert [cls.priority(b) for b in bks] == [100] * 4
    # the session's own last turn (the same context, the same scope) does release it
    own = _request(eng, "a-final", _envelope(_retain("chat", {"priority": 0})), ours,
                   params={"X-Dynamo-Session-Final": True})
    _lookup_each(eng, own, ours)
    _finish(eng, own)
    assert [cls.priority(b) for b in bks] == [0] * 4


def test_another_session_can_raise_a_chunks_retention_but_never_lower_it(eng: Engine) -> None:
    ks = keys(4, tag="shared")
    _protect(eng, ks)
    cls = eng.tier.store.retention.retention_of(0)
    bks = block_keys(eng.tier.namespace, ks)
    for scope, directive in (("other", {"priority": 1, "duration": 1}), ("other", {"priority": 0}),
                             (None, {"priority": 1, "duration": 0})):
        ctx = _request(eng, f"low-{scope}", _envelope(_retain(scope, directive)), ks,
                       params={"X-Dynamo-Session-Final": True})
        _lookup_each(eng, ctx, ks)
        _finish(eng, ctx)
        assert [cls.priority(b) for b in bks] == [100] * 4, (scope, directive)
        assert all(cls.get(b).expiry > eng.tier.store.retention.clock() + 3000 for b in bks)
    assert not eng.tier.store.expire().blocks.get("ssd")  # nothing counts as expired


def test_random_hostile_envelopes_stay_bounded_and_never_lower_others(eng: Engine) -> None:
    """Property: requests with random hostile envelopes (many directives, huge or colliding
    scopes, floods of prefetch and session ends) cost each chunk at most one retain, the request
    a few plans and at most ``MAX_PREFETCH_ACTIONS`` prefetches, and leave a chunk another holder
    protects at its priority."""
    rng = random.Random(7)
    chunk = eng.tier._hints.chunk_tokens
    ks = keys(64, tag="victim")
    _protect(eng, ks, scope="vault")  # a session the attackers share a tenant with but do not name
    cls = eng.tier.store.retention.retention_of(0)
    bks = block_keys(eng.tier.namespace, ks)
    retains, prefetches = _Counted(eng.tier.store, "retain"), _Counted(eng.tier.store, "prefetch")
    for r in range(30):
        actions: list[tuple[str, dict[str, Any]]] = []
        scope = rng.choice(["chat", "other", None, "z" * rng.choice([10, 300, 100_000])])
        n_dir = rng.choice([0, 1, 128, 500])
        prios = sorted((rng.randint(0, 100) for _ in range(n_dir)), reverse=True)
        actions.append(_retain(scope, *({"start": i * chunk, "end": None, "priority": p,
                                          "duration": rng.choice([0, 1, None, 1e9])} for i, p in enumerate(prios))))
        actions += [("dtkv.prefetch", {"scope": rng.choice(["chat", "other"])})] * rng.choice([0, 5, 300])
        mine = ks[:rng.randint(1, 64)] if rng.random() < 0.5 else keys(64, tag=f"attacker-{r}")
        before = (retains.keys, prefetches.calls)
        ctx = _request(eng, f"hostile-{r}", _envelope(*actions), mine,
                       params={"X-Dynamo-Session-Final": rng.random() < 0.5})
        for _ in range(3):
            _lookup_each(eng, ctx, mine)
        _finish(eng, ctx)
        st = ctx.get_state(SessionHints)
        assert st is not None and (st.plan is None or st.plan.plans <= 2)
        assert retains.keys - before[0] <= len(mine)
        assert prefetches.calls - before[1] <= MAX_PREFETCH_ACTIONS
        assert [cls.priority(b) for b in bks] == [100] * 64, f"round {r} lowered the victim's retention"
