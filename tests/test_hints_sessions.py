"""The session rules both vLLM adapters share (``hints.sessions``) and the per-request bounds
(``hints.limits``): plans made a bounded number of times and exact, sessions kept per tenant and
capped exactly, scopes and prefetch actions bounded, one rule for a session's end."""

from __future__ import annotations

import random

import pytest

from dynamo_tiered_kv.hints import HintStats, RetainDirective, plan_retention, read_hints
from dynamo_tiered_kv.hints.limits import MAX_PREFETCH_ACTIONS, MAX_SCOPE_CHARS
from dynamo_tiered_kv.hints.reader import RequestHints
from dynamo_tiered_kv.hints.retain import RetainClaim
from dynamo_tiered_kv.hints.sessions import RetentionCursor, SessionScopes, ends_session, holder


def _directives(rng: random.Random, n: int, tokens: int) -> tuple[RetainDirective, ...]:
    """``n`` random directives whose priorities never increase along the token axis."""
    starts = sorted([0] + [rng.randrange(tokens) for _ in range(n - 1)])  # from 0: a prefix is protected
    prios = sorted((rng.randint(1, 100) for _ in range(n)), reverse=True)
    out = []
    for s, p in zip(starts, prios):
        end = None if rng.random() < 0.3 else s + rng.randint(1, tokens)
        out.append(RetainDirective(p, s, end, rng.choice([None, 60.0, 3600.0])))
    if rng.random() < 0.5:
        out.append(RetainDirective(min(prios), covers_output=True, duration=600.0))
    return tuple(out)


@pytest.mark.parametrize("seed", range(20))
def test_the_cursor_gives_every_block_what_a_full_plan_gives(seed: int) -> None:
    rng = random.Random(seed)
    bs, prompt = 16, rng.randint(1, 2000)
    claim = RetainClaim("s", _directives(rng, rng.randint(1, 40), prompt + 500))
    blocks = (prompt + rng.randint(0, 3000)) // bs  # prompt plus generated tokens, full blocks
    now = 1000.0
    cursor = RetentionCursor(claim, block_size=bs, prompt_tokens=prompt, now=now)
    # blocks come one at a time, in order (vLLM's lookups and saves), then a span again
    got = [cursor.at(i) for i in range(blocks)]
    total = blocks * bs
    full = plan_retention(claim.directives, block_size=bs, num_prompt_tokens=prompt,
                          num_output_tokens=max(0, total - prompt), now=now, num_blocks=blocks)
    assert got == full.blocks()
    assert any(r is not None and r.priority > 0 for r in got)  # the plan protects something
    assert dict(cursor.span(0, blocks)) == {i: r for i, r in enumerate(full.blocks()) if r is not None}


def test_a_request_is_planned_a_bounded_number_of_times() -> None:
    claim = RetainClaim("s", tuple(RetainDirective(100 - i // 2, i * 16, None, 3600.0) for i in range(128)))
    cursor = RetentionCursor(claim, block_size=16, prompt_tokens=2048 * 16, now=0.0)
    for i in range(2048 * 4):  # a 32k-token prompt and three times as many generated tokens
        cursor.at(i)
    assert cursor.plans <= 4  # the prompt, then horizons 4096 and 8192 blocks


def test_unknown_prompt_plans_every_block_as_prompt() -> None:
    claim = RetainClaim(None, (RetainDirective(50, covers_output=True),))
    cursor = RetentionCursor(claim, block_size=16, prompt_tokens=None, now=0.0)
    assert [cursor.at(i) for i in range(10)] == [None] * 10  # covers_output protects nothing


def test_sessions_are_kept_per_tenant() -> None:
    scopes: SessionScopes[bytes] = SessionScopes()
    a, b = ("tenant-a", "chat"), ("tenant-b", "chat")
    scopes.remember(a, enumerate([b"k0", b"k1", b"k2"]))
    assert scopes.span(b, 0, None) is None  # another tenant's session of the same name is not found
    assert scopes.forget(b) == []
    assert scopes.span(a, 1, None) == [b"k1", b"k2"]
    assert scopes.latest("chat") == a
    scopes.remember(("tenant-a", None), enumerate([b"x"]))  # unscoped requests name no session
    assert len(scopes) == 1


def test_the_per_session_block_cap_is_exact() -> None:
    scopes: SessionScopes[int] = SessionScopes(max_blocks=1000)
    owner = ("t", "s")
    for first in range(0, 1500, 100):  # 15 batches of 100 blocks; the cap falls inside one
        scopes.remember(owner, ((i, i) for i in range(first, first + 100)))
    assert scopes.blocks_of(owner) == 1000
    assert scopes.span(owner, 0, None) == list(range(1000))


def test_sessions_are_bounded_least_recently_used_first() -> None:
    scopes: SessionScopes[int] = SessionScopes(max_scopes=3)
    for i in range(4):
        scopes.remember(("t", f"s{i}"), [(0, i)])
    assert len(scopes) == 3 and scopes.span(("t", "s0"), 0, None) is None


def test_a_holder_is_the_tenant_and_the_scope() -> None:
    assert holder("t", RetainClaim("s", ())) == ("t", "s")
    assert holder("t", None) == ("t", None)


def _envelope(*actions: tuple[str, dict]) -> dict:
    return {"protocol_version": "1.0", "message_id": "m", "actions": [
        {"action_id": f"a{i}", "action_type": t, "action_version": "1.0", "payload": p}
        for i, (t, p) in enumerate(actions)]}


def _hints(*actions: tuple[str, dict]) -> RequestHints:
    hints = read_hints(kv_transfer_params={"kv_hints": _envelope(*actions)}, stats=HintStats())
    assert hints is not None
    return hints


def test_an_empty_directive_list_does_not_end_the_session() -> None:
    assert not ends_session(False, _hints(("kv.retain", {"scope": "s", "directives": []})))
    assert ends_session(False, _hints(("kv.retain", {"scope": "s", "directives": [{"priority": 0}]})))
    assert not ends_session(False, _hints(("kv.retain", {"scope": "s", "directives": [{"priority": 1}]})))
    assert ends_session(True, None)
    assert not ends_session(False, None)


def test_a_retain_scope_is_bounded_like_a_prefetch_scope() -> None:
    stats = HintStats()
    huge = read_hints(kv_transfer_params={"kv_hints": _envelope(
        ("kv.retain", {"scope": "x" * (MAX_SCOPE_CHARS + 1), "directives": [{"priority": 5}]}))}, stats=stats)
    assert huge is not None and huge.retain is None
    assert stats.rejections("kv.retain", "scope") == 1
    ok = _hints(("kv.retain", {"scope": "x" * MAX_SCOPE_CHARS, "directives": [{"priority": 5}]}))
    assert ok.retain is not None and len(ok.retain.scope or "") == MAX_SCOPE_CHARS
    assert _hints(("kv.retain", {"scope": "", "directives": [{"priority": 5}]})).retain is None


def test_prefetch_actions_past_the_cap_are_dropped_and_counted() -> None:
    stats = HintStats()
    env = _envelope(*[("dtkv.prefetch", {"scope": f"s{i}"}) for i in range(256)])
    hints = read_hints(kv_transfer_params={"kv_hints": env}, stats=stats)
    assert hints is not None and len(hints.prefetch) == MAX_PREFETCH_ACTIONS
    assert stats.actions("dtkv.prefetch", "dropped") == 256 - MAX_PREFETCH_ACTIONS
