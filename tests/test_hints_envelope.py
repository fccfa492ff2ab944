"""Where hints come from, what a bad envelope costs (never the request), and the prefetch actions."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from dynamo_tiered_kv.hints import (
    FETCH_ACTION,
    PREFETCH_ACTION,
    RETAIN_ACTION,
    FetchHint,
    HintStats,
    PrefetchHint,
    RetainDirective,
    read_hints,
)
from dynamo_tiered_kv.hints.envelope import MAX_ENVELOPE_ACTIONS, MAX_ENVELOPE_JSON_BYTES
from dynamo_tiered_kv.hints.prefetch import MAX_FETCH_HASHES, MAX_SCOPE_CHARS


def _act(kind, payload, version="1.0", ident="a"):
    return {"action_id": ident, "action_type": kind, "action_version": version, "payload": payload}


def _env(*actions, message_id="m1"):
    return {"protocol_version": "0.1", "message_id": message_id, "actions": list(actions)}


RETAIN = _act(RETAIN_ACTION, {"scope": "chat-1", "directives": [{"start": 0, "end": 64, "priority": 70}]})


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("key", ["kv_hints", "kv_hint"])
def test_envelope_in_kv_transfer_params(key):
    stats = HintStats()
    hints = read_hints(kv_transfer_params={"do_remote_prefill": False, key: _env(RETAIN)}, stats=stats)
    assert hints is not None and hints.message_id == "m1"
    assert hints.retain is not None and hints.retain.scope == "chat-1"
    assert hints.retain.directives == (RetainDirective(70, 0, 64),)
    assert stats.envelopes("ok") == 1


def test_envelope_as_json_text_and_on_a_request_object():
    stats = HintStats()
    text = json.dumps(_env(RETAIN))
    req = SimpleNamespace(kv_hints=None, kv_transfer_params={"kv_hints": text})
    assert read_hints(req, stats=stats).retain.directives == (RetainDirective(70, 0, 64),)
    assert read_hints(SimpleNamespace(kv_hints=_env(RETAIN)), stats=stats).retain is not None
    assert read_hints(kv_transfer_params={"kv_hints": text.encode()}, stats=stats).retain is not None
    assert stats.envelopes("ok") == 3


def test_typed_field_wins_over_transfer_params():
    typed = _env(_act(RETAIN_ACTION, {"scope": "typed", "directives": []}))
    req = SimpleNamespace(kv_hints=typed, kv_transfer_params={"kv_hints": _env(RETAIN)})
    assert read_hints(req, stats=HintStats()).retain.scope == "typed"


def test_kv_hints_key_wins_over_kv_hint():
    other = _env(_act(RETAIN_ACTION, {"scope": "other", "directives": []}))
    hints = read_hints(kv_transfer_params={"kv_hint": other, "kv_hints": _env(RETAIN)}, stats=HintStats())
    assert hints.retain.scope == "chat-1"


@pytest.mark.parametrize("req, params", [
    (None, None),
    (SimpleNamespace(), None),
    (SimpleNamespace(kv_hints=None, kv_transfer_params=None), None),
    (SimpleNamespace(kv_hints=None, kv_transfer_params={"remote_host": "h"}), None),
    (None, {"kv_hints": None}),
    (None, "not a mapping"),
])
def test_no_envelope_is_none_and_not_counted(req, params):
    stats = HintStats()
    assert read_hints(req, kv_transfer_params=params, stats=stats) is None
    assert stats.envelopes("ok") == stats.envelopes("malformed") == 0


def test_unknown_actions_are_counted_and_ignored():
    stats = HintStats()
    hints = read_hints(kv_transfer_params={"kv_hints": _env(
        _act("vllm.set_priority", {"value": 3}, ident="x"), RETAIN, _act("kv.future_action", {}, "7.3", "y"))},
        stats=stats)
    assert hints is not None and hints.retain is not None
    assert hints.ignored == ("vllm.set_priority", "kv.future_action")
    assert stats.actions("unknown", "ignored") == 2


class _Exploding:
    def __getattr__(self, name):
        raise RuntimeError(name)


class _BadMapping(dict):
    def get(self, *a, **k):
        raise RuntimeError("get")


MALFORMED = [
    42, [], "not json", "[1, 2]", b"\xff\xfe", "{" * 100_000,
    '{"protocol_version": "0.1", "message_id": "' + "x" * MAX_ENVELOPE_JSON_BYTES + '", "actions": []}',
    {}, {"actions": []}, {"protocol_version": 1, "message_id": "m", "actions": []},
    {"protocol_version": "0.1", "message_id": None, "actions": []},
    {"protocol_version": "0.1", "message_id": "m", "actions": "bad"},
    {"protocol_version": "0.1", "message_id": "m", "actions": {"a": 1}},
    {"protocol_version": "0.1", "message_id": "m"},
    _BadMapping(protocol_version="0.1", message_id="m", actions=[]),
]


@pytest.mark.parametrize("raw", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_envelope_is_counted_never_raised(raw):
    stats = HintStats()
    assert read_hints(kv_transfer_params={"kv_hints": raw}, stats=stats) is None
    assert read_hints(SimpleNamespace(kv_hints=raw), stats=stats) is None
    assert stats.envelopes("malformed") == 2 and stats.envelopes("ok") == 0


def test_request_whose_attributes_raise_is_counted_never_raised():
    stats = HintStats()
    assert read_hints(_Exploding(), stats=stats) is None
    assert stats.envelopes("malformed") == 1


def test_payload_that_raises_costs_the_envelope_only():
    stats = HintStats()
    env = _env(_act(RETAIN_ACTION, _BadMapping(scope="s", directives=[])))
    assert read_hints(kv_transfer_params={"kv_hints": env}, stats=stats) is None
    assert stats.envelopes("unparsable") == 1


def test_malformed_envelopes_log_one_line_per_interval(caplog):
    clock = _Clock()
    stats = HintStats(log_interval_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="dynamo_tiered_kv.hints.stats"):
        for _ in range(50):
            read_hints(kv_transfer_params={"kv_hints": "junk"}, stats=stats)
        assert len(caplog.records) == 1
        clock.t += 61.0
        read_hints(kv_transfer_params={"kv_hints": "junk"}, stats=stats)
    assert len(caplog.records) == 2 and "49 similar suppressed" in caplog.records[1].getMessage()
    assert stats.envelopes("malformed") == 51


def test_bad_action_frames_reject_only_that_action():
    stats = HintStats()
    hints = read_hints(kv_transfer_params={"kv_hints": _env(
        "not an action",
        {"action_id": 1, "action_type": RETAIN_ACTION, "action_version": "1.0", "payload": {}},
        _act(RETAIN_ACTION, ["not", "a", "dict"], ident="p"),
        RETAIN)}, stats=stats)
    assert hints is not None and hints.retain is not None and len(hints.retain.directives) == 1
    assert stats.rejections(RETAIN_ACTION, "action") == 1
    assert stats.rejections(RETAIN_ACTION, "payload") == 1
    assert stats.actions("unknown", "ignored") == 1  # the frame without a type


def test_actions_past_the_envelope_cap_are_not_looked_at():
    stats = HintStats()
    env = _env(*[_act("x.other", {})] * MAX_ENVELOPE_ACTIONS, RETAIN)
    hints = read_hints(kv_transfer_params={"kv_hints": env}, stats=stats)
    assert hints is not None and hints.retain is None
    assert stats.actions("unknown", "dropped") == 1


def test_counters_export_to_a_prometheus_registry():
    registry = CollectorRegistry()
    stats = HintStats()
    stats.register(registry)
    read_hints(kv_transfer_params={"kv_hints": _env(RETAIN, _act("x.y", {}))}, stats=stats)
    read_hints(kv_transfer_params={"kv_hints": "junk"}, stats=stats)
    read_hints(kv_transfer_params={"kv_hints": _env(_act(RETAIN_ACTION, {"directives": 1}))}, stats=stats)
    v = registry.get_sample_value
    assert v("dtkv_hint_envelopes_total", {"outcome": "ok"}) == 2
    assert v("dtkv_hint_envelopes_total", {"outcome": "malformed"}) == 1
    assert v("dtkv_hint_actions_total", {"action": RETAIN_ACTION, "outcome": "accepted"}) == 1
    assert v("dtkv_hint_actions_total", {"action": "unknown", "outcome": "ignored"}) == 1
    assert v("dtkv_hint_rejections_total", {"action": RETAIN_ACTION, "reason": "directives"}) == 1


# -- prefetch actions ---------------------------------------------------------------------------

def _prefetch(payload, version="1.0"):
    stats = HintStats()
    hints = read_hints(kv_transfer_params={"kv_hints": _env(_act(PREFETCH_ACTION, payload, version))},
                       stats=stats)
    return hints, stats


def _fetch(payload, version="1.0"):
    stats = HintStats()
    hints = read_hints(kv_transfer_params={"kv_hints": _env(_act(FETCH_ACTION, payload, version))}, stats=stats)
    return hints, stats


def test_prefetch_parses():
    assert _prefetch({"scope": "chat-1"})[0].prefetch == (PrefetchHint("chat-1"),)
    assert _prefetch({"scope": "chat-1", "start": 64, "end": 128})[0].prefetch == (PrefetchHint("chat-1", 64, 128),)
    assert _prefetch({"scope": "c", "end": None})[0].prefetch == (PrefetchHint("c"),)


@pytest.mark.parametrize("payload, reason, version", [
    ({}, "scope", "1.0"),
    ({"scope": ""}, "scope", "1.0"),
    ({"scope": 5}, "scope", "1.0"),
    ({"scope": "x" * (MAX_SCOPE_CHARS + 1)}, "scope", "1.0"),
    ({"scope": "c", "start": -1}, "start", "1.0"),
    ({"scope": "c", "start": True}, "start", "1.0"),
    ({"scope": "c", "start": 8, "end": 8}, "end", "1.0"),
    ({"scope": "c", "end": 1.5}, "end", "1.0"),
    ({"scope": "c", "tier": "ssd"}, "fields", "1.0"),
    ({"scope": "c"}, "version", "2.0"),
])
def test_prefetch_rejections(payload, reason, version):
    hints, stats = _prefetch(payload, version)
    assert hints.prefetch == () and stats.rejections(PREFETCH_ACTION, reason) == 1


def test_fetch_parses_dynamo_payload():
    hints, stats = _fetch({"source_control_endpoint": "tcp://10.0.0.7:23280", "block_hashes": [11, 2**64 - 1],
                           "mode": "copy", "future_field": {"x": 1}})
    assert hints.fetch == (FetchHint("tcp://10.0.0.7:23280", (11, 2**64 - 1), "copy"),)
    assert stats.actions(FETCH_ACTION, "accepted") == 1


@pytest.mark.parametrize("payload, reason, version", [
    ({"block_hashes": [1]}, "source", "1.0"),
    ({"source_control_endpoint": "", "block_hashes": [1]}, "source", "1.0"),
    ({"source_control_endpoint": 7, "block_hashes": [1]}, "source", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": []}, "block_hashes", "1.0"),
    ({"source_control_endpoint": "tcp://h:1"}, "block_hashes", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": [True]}, "block_hashes", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": [-1]}, "block_hashes", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": [2**64]}, "block_hashes", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": ["ab"]}, "block_hashes", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": [1] * (MAX_FETCH_HASHES + 1)}, "block_hashes", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": [1], "mode": 3}, "mode", "1.0"),
    ({"source_control_endpoint": "tcp://h:1", "block_hashes": [1]}, "version", "0.9"),
])
def test_fetch_rejections(payload, reason, version):
    hints, stats = _fetch(payload, version)
    assert hints.fetch == () and stats.rejections(FETCH_ACTION, reason) == 1


def test_a_rejected_action_leaves_the_others():
    stats = HintStats()
    hints = read_hints(kv_transfer_params={"kv_hints": _env(
        _act(PREFETCH_ACTION, {"scope": ""}, ident="bad"), _act(PREFETCH_ACTION, {"scope": "s"}, ident="ok"),
        RETAIN)}, stats=stats)
    assert hints.prefetch == (PrefetchHint("s"),) and hints.retain is not None
    assert stats.actions(PREFETCH_ACTION, "rejected") == 1


def test_a_rejection_logs_one_bounded_line(caplog):
    directive = {"priority": 5, **{f"field-{i}-" + "x" * 100: 1 for i in range(1000)}}
    env = _env(_act(RETAIN_ACTION, {"directives": [directive]}, ident="i" * 10_000))
    with caplog.at_level(logging.WARNING, logger="dynamo_tiered_kv.hints.stats"):
        read_hints(kv_transfer_params={"kv_hints": env}, stats=HintStats())
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < 400
