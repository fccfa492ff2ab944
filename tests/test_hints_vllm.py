"""Both transports on vLLM's own Request: the typed ``kv_hints`` field and ``kv_transfer_params``."""

from __future__ import annotations

import pytest

from dynamo_tiered_kv.hints import RETAIN_ACTION, HintStats, RetainDirective, plan_retention, read_hints

kv_hints = pytest.importorskip("vllm.v1.kv_hints", reason="this vLLM has no kv_hints field")
vllm_request = pytest.importorskip("vllm.v1.request")
SamplingParams = pytest.importorskip("vllm").SamplingParams

PAYLOAD = {"scope": "chat-1", "directives": [{"start": 0, "end": 40, "priority": 80, "duration": 3600},
                                              {"covers_output": True, "priority": 20}]}


def _request(*, typed=None, params=None):
    extra = {"kv_transfer_params": params} if params is not None else None
    return vllm_request.Request("r1", list(range(40)), SamplingParams(max_tokens=8, extra_args=extra), None,
                                kv_hints=typed)


def test_typed_envelope_on_the_request():
    env = kv_hints.KvHintsEnvelope(protocol_version="0.1", message_id="router/1", actions=[
        kv_hints.KvHintAction(action_id="a1", action_type=RETAIN_ACTION, action_version="1.0", payload=PAYLOAD),
        kv_hints.KvHintAction(action_id="a2", action_type="vllm.set_priority", action_version="1.0", payload={}),
    ])
    stats = HintStats()
    hints = read_hints(_request(typed=env), stats=stats)
    assert hints is not None and hints.message_id == "router/1" and hints.ignored == ("vllm.set_priority",)
    assert hints.retain.directives == (RetainDirective(80, 0, 40, 3600.0), RetainDirective(20, covers_output=True))
    plan = plan_retention(hints.retain.directives, block_size=16, num_prompt_tokens=40, num_output_tokens=8, now=0.0)
    assert [b.priority for b in plan.blocks()] == [80, 80, 20]


def test_envelope_in_the_requests_transfer_params():
    env = {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "a", "action_type": RETAIN_ACTION, "action_version": "1.0", "payload": PAYLOAD}]}
    stats = HintStats()
    hints = read_hints(_request(params={"kv_hints": env}), stats=stats)
    assert hints is not None and hints.retain.scope == "chat-1"
    assert read_hints(_request(params={"kv_hints": "{not json"}), stats=stats) is None
    assert read_hints(_request(), stats=stats) is None
    assert stats.envelopes("ok") == 1 and stats.envelopes("malformed") == 1
