"""kv.retain@1.0: every rule that rejects an action, the caps that drop, and what is accepted."""

from __future__ import annotations

import pytest

from dynamo_tiered_kv.hints import (
    MAX_DIRECTIVES,
    MAX_DURATION_S,
    MAX_RETAIN_ACTIONS,
    RETAIN_ACTION,
    HintAction,
    HintStats,
    RetainDirective,
    collect_retain,
)


def _retain(directives, scope="s", *, version="1.0", ident="a", **extra):
    return HintAction(ident, RETAIN_ACTION, version, {"scope": scope, "directives": directives, **extra})


def _collect(*actions):
    stats = HintStats()
    return collect_retain(actions, stats), stats


GOOD = {"start": 0, "end": 32, "priority": 50}


def test_valid_directives_parse_in_order():
    claim, stats = _collect(_retain([
        {"start": 0, "end": 32, "priority": 80, "duration": 60},
        {"start": 32, "end": None, "priority": 40, "duration": 0.5},
        {"covers_output": True, "priority": 10},
        {"start": 64, "priority": 10, "covers_output": False},
    ]))
    assert claim is not None and claim.scope == "s"
    assert claim.directives == (
        RetainDirective(80, 0, 32, 60.0),
        RetainDirective(40, 32, None, 0.5),
        RetainDirective(10, covers_output=True),
        RetainDirective(10, 64),
    )
    assert stats.actions(RETAIN_ACTION, "accepted") == 1
    assert stats.actions(RETAIN_ACTION, "rejected") == 0


def test_boundaries_are_accepted():
    claim, _ = _collect(_retain([
        {"start": 0, "end": 1, "priority": 100, "duration": MAX_DURATION_S},
        {"start": 1, "end": 2, "priority": 0, "duration": 0},
    ]))
    assert claim is not None
    assert [d.priority for d in claim.directives] == [100, 0]
    assert claim.directives[0].duration == MAX_DURATION_S


def test_scope_may_be_absent_or_null_and_directives_empty():
    claim, _ = _collect(HintAction("a", RETAIN_ACTION, "1.0", {"directives": []}))
    assert claim is not None and claim.scope is None and claim.directives == ()


@pytest.mark.parametrize("bad, reason", [
    ({"start": 0, "end": 16}, "priority"),
    ({"start": 0, "end": 16, "priority": None}, "priority"),
    ({"start": 0, "end": 16, "priority": 101}, "priority"),
    ({"start": 0, "end": 16, "priority": -1}, "priority"),
    ({"start": 0, "end": 16, "priority": True}, "priority"),
    ({"start": 0, "end": 16, "priority": 5.0}, "priority"),
    ({"start": 0, "end": 16, "priority": "5"}, "priority"),
    ({"start": -1, "end": 16, "priority": 10}, "start"),
    ({"start": None, "end": 16, "priority": 10}, "start"),
    ({"start": False, "end": 16, "priority": 10}, "start"),
    ({"start": 1.0, "end": 16, "priority": 10}, "start"),
    ({"start": 16, "end": 16, "priority": 10}, "end"),
    ({"start": 16, "end": 8, "priority": 10}, "end"),
    ({"start": 0, "end": 16.0, "priority": 10}, "end"),
    ({"start": 0, "end": True, "priority": 10}, "end"),
    ({"start": 0, "end": 16, "priority": 10, "duration": -1}, "duration"),
    ({"start": 0, "end": 16, "priority": 10, "duration": MAX_DURATION_S + 1}, "duration"),
    ({"start": 0, "end": 16, "priority": 10, "duration": float("nan")}, "duration"),
    ({"start": 0, "end": 16, "priority": 10, "duration": float("inf")}, "duration"),
    ({"start": 0, "end": 16, "priority": 10, "duration": 10**400}, "duration"),
    ({"start": 0, "end": 16, "priority": 10, "duration": True}, "duration"),
    ({"start": 0, "end": 16, "priority": 10, "duration": "60"}, "duration"),
    ({"start": 0, "end": 16, "priority": 10, "bogus": 1}, "fields"),
    ({"covers_output": "true", "priority": 10}, "covers_output"),
    ({"covers_output": None, "priority": 10}, "covers_output"),
    ({"covers_output": True, "start": 0, "priority": 10}, "covers_output"),
    ({"covers_output": True, "end": 16, "priority": 10}, "covers_output"),
    ({"covers_output": True, "start": None, "priority": 10}, "start"),
    ("not-an-object", "directive"),
    (None, "directive"),
    ([0, 16, 10], "directive"),
])
def test_each_invalid_directive_rejects_its_action_alone(bad, reason):
    claim, stats = _collect(_retain([GOOD, bad], ident="bad"), _retain([GOOD], ident="good"))
    assert stats.rejections(RETAIN_ACTION, reason) == 1
    assert stats.actions(RETAIN_ACTION, "rejected") == 1
    assert claim is not None and claim.directives == (RetainDirective(50, 0, 32),)


@pytest.mark.parametrize("payload, reason", [
    ({"scope": 7, "directives": []}, "scope"),
    ({"scope": ["s"], "directives": []}, "scope"),
    ({"scope": "s"}, "directives"),
    ({"scope": "s", "directives": {}}, "directives"),
    ({"scope": "s", "directives": "[]"}, "directives"),
])
def test_invalid_payload_rejects_the_action(payload, reason):
    claim, stats = _collect(HintAction("a", RETAIN_ACTION, "1.0", payload))
    assert claim is None
    assert stats.rejections(RETAIN_ACTION, reason) == 1


@pytest.mark.parametrize("version", ["2.0", "0.1", "", "v1", "x.1", "².0", " 1.0", "1a.0", "1 .0", "-1.0"])
def test_other_major_versions_are_rejected(version):
    claim, stats = _collect(_retain([GOOD], version=version))
    assert claim is None and stats.rejections(RETAIN_ACTION, "version") == 1


@pytest.mark.parametrize("version", ["1", "1.0", "1.3", "1.0.7"])
def test_any_minor_of_major_1_is_accepted(version):
    claim, _ = _collect(_retain([GOOD], version=version))
    assert claim is not None and len(claim.directives) == 1


@pytest.mark.parametrize("directives", [
    [{"start": 0, "end": 100, "priority": 30}, {"start": 100, "end": 200, "priority": 80}],
    [{"start": 100, "end": 200, "priority": 80}, {"start": 0, "end": 100, "priority": 30}],  # sorted first
    [{"start": 0, "end": 100, "priority": 30}, {"covers_output": True, "priority": 60}],  # output sorts last
    [{"start": 0, "end": 100, "priority": 30}, {"priority": 40}],  # start defaults to 0: tie keeps order
])
def test_priority_increasing_along_tokens_is_rejected(directives):
    claim, stats = _collect(_retain(directives))
    assert claim is None and stats.rejections(RETAIN_ACTION, "order") == 1


def test_equal_and_decreasing_priorities_are_accepted():
    claim, _ = _collect(_retain([
        {"start": 200, "end": 300, "priority": 60},
        {"start": 0, "end": 100, "priority": 90},
        {"start": 100, "end": 200, "priority": 60},
        {"covers_output": True, "priority": 0},
    ]))
    assert claim is not None and len(claim.directives) == 4


def test_order_is_checked_per_action_not_across_actions():
    # an executor skips invalid actions one by one; across actions the plan's clamp applies
    claim, stats = _collect(_retain([{"start": 0, "end": 16, "priority": 30}], ident="a1"),
                            _retain([{"start": 16, "end": 32, "priority": 80}], ident="a2"))
    assert claim is not None and [d.priority for d in claim.directives] == [30, 80]
    assert stats.actions(RETAIN_ACTION, "rejected") == 0


def test_actions_concatenate_and_a_different_scope_is_rejected():
    claim, stats = _collect(_retain([GOOD], scope="a", ident="1"),
                            _retain([{"start": 32, "end": 64, "priority": 50}], scope="b", ident="2"),
                            _retain([{"start": 64, "end": 96, "priority": 50}], scope="a", ident="3"))
    assert claim is not None and claim.scope == "a"
    assert [d.start for d in claim.directives] == [0, 64]
    assert stats.rejections(RETAIN_ACTION, "scope_conflict") == 1


def test_the_first_valid_action_fixes_the_scope():
    claim, stats = _collect(_retain(["bad"], scope="a", ident="1"), _retain([GOOD], scope="b", ident="2"))
    assert claim is not None and claim.scope == "b"
    assert stats.rejections(RETAIN_ACTION, "directive") == 1


def test_actions_past_the_cap_are_dropped_not_rejected():
    actions = [_retain([{"start": 16 * i, "end": 16 * i + 16, "priority": 50}], ident=str(i))
               for i in range(MAX_RETAIN_ACTIONS + 3)]
    claim, stats = _collect(*actions)
    assert claim is not None and len(claim.directives) == MAX_RETAIN_ACTIONS
    assert stats.actions(RETAIN_ACTION, "dropped") == 3
    assert stats.actions(RETAIN_ACTION, "accepted") == MAX_RETAIN_ACTIONS


def test_directives_past_the_envelope_cap_are_truncated_in_order():
    def block(i):
        return {"start": 16 * i, "end": 16 * i + 16, "priority": 50}
    claim, stats = _collect(_retain([block(i) for i in range(MAX_DIRECTIVES - 1)], ident="1"),
                            _retain([block(MAX_DIRECTIVES - 1), block(MAX_DIRECTIVES)], ident="2"))
    assert claim is not None
    assert [d.start for d in claim.directives] == [16 * i for i in range(MAX_DIRECTIVES)]
    assert stats.truncated() == 1 and stats.actions(RETAIN_ACTION, "rejected") == 0


def test_a_bad_directive_past_the_cap_is_not_looked_at():
    claim, _ = _collect(_retain([GOOD] * MAX_DIRECTIVES + ["bad"]))
    assert claim is not None and len(claim.directives) == MAX_DIRECTIVES


def test_other_actions_are_not_retain():
    claim, stats = _collect(HintAction("a", "kv.retainx", "1.0", {"directives": [GOOD]}),
                            HintAction("b", "vllm.set_priority", "1.0", {}))
    assert claim is None and stats.actions(RETAIN_ACTION, "rejected") == 0
