"""Our vLLM connector's session hints past the prompt: ``covers_output`` protects the blocks a
request generates as it saves them; ``kv.fetch`` and unknown ``dtkv.prefetch`` scopes are
counted and cost the request nothing (scheduler and worker roles over a real host and SSD tier)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from test_connector_hints import HintedRequest, _roles
from test_connector_scheduler import BS, sched_output

from dynamo_tiered_kv.hints import FETCH_ACTION, PREFETCH_ACTION


@dataclass
class PromptRequest(HintedRequest):
    num_prompt_tokens: int = 0


def _hints(*actions: tuple[str, dict]) -> dict:
    return {"kv_hints": {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": f"a{i}", "action_type": kind, "action_version": "1.0", "payload": payload}
        for i, (kind, payload) in enumerate(actions)]}}


def test_covers_output_protects_the_generated_blocks_as_they_are_saved(tmp_path) -> None:
    """A prompt of 4 blocks and 3 tokens, then 9 generated tokens: 7 full blocks. The prompt's
    directive (80) covers blocks 0-3 whole; block 4 holds 3 prompt tokens and the first generated
    one, so it gets the weaker covers_output level (50), as do blocks 5 and 6."""
    sched, w = _roles(tmp_path)
    try:
        prompt = 4 * BS + 3
        req = PromptRequest("a", list(range(prompt)), num_prompt_tokens=prompt, kv_transfer_params=_hints(
            ("kv.retain", {"scope": "s", "directives": [
                {"start": 0, "end": prompt, "priority": 80, "duration": 3600},
                {"covers_output": True, "priority": 50, "duration": 600}]})))
        ids = list(range(1, 9))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids[:5],)), 0)
        meta = sched.build_connector_meta(sched_output(new=[("a", ids[:5], 0)], tokens={"a": prompt}))
        assert [len(s.block_ids) for s in meta.saves] == [4]
        w.start_load_kv(meta)
        req.all_token_ids += list(range(1000, 1009))  # decoding: 9 generated tokens
        meta = sched.build_connector_meta(sched_output(cached=[("a", ids[5:7], prompt)], tokens={"a": 9}))
        assert [len(s.block_ids) for s in meta.saves] == [3]
        w.start_load_kv(meta)
        keys = w.keys_of(sched._reqs["a"].hashes_upto(7))
        host = w.store.retention.retention_of(0)
        assert [host.priority(k) for k in keys] == [80, 80, 80, 80, 50, 50, 50]
        assert host.get(keys[3]).expiry > host.get(keys[4]).expiry  # each block takes its level's expiry
    finally:
        w.shutdown()


def test_a_prompt_only_claim_leaves_generated_blocks_alone(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        prompt = 2 * BS
        req = PromptRequest("a", list(range(prompt)), num_prompt_tokens=prompt, kv_transfer_params=_hints(
            ("kv.retain", {"directives": [{"start": 0, "end": prompt, "priority": 70}]})))
        ids = [1, 2, 3, 4]
        sched.get_num_new_matched_tokens(req, 0)
        w.start_load_kv(sched.build_connector_meta(sched_output(new=[("a", ids[:2], 0)], tokens={"a": prompt})))
        req.all_token_ids += list(range(1000, 1000 + 2 * BS))
        meta = sched.build_connector_meta(sched_output(cached=[("a", ids[2:], prompt)], tokens={"a": 2 * BS}))
        assert meta.retains == []  # nothing to say about the generated blocks
        w.start_load_kv(meta)
        host = w.store.retention.retention_of(0)
        assert [host.priority(k) for k in w.keys_of(sched._reqs["a"].hashes_upto(4))] == [70, 70, 0, 0]
    finally:
        w.shutdown()


def test_kv_fetch_and_an_unknown_prefetch_scope_are_counted_and_harmless(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        req = PromptRequest("a", list(range(3 * BS + 1)), num_prompt_tokens=3 * BS + 1, kv_transfer_params=_hints(
            ("kv.fetch", {"source_control_endpoint": "tcp://10.0.0.7:23280", "block_hashes": [1, 2, 3]}),
            ("dtkv.prefetch", {"scope": "never-seen"})))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        meta = sched.build_connector_meta(sched_output(new=[("a", [1, 2, 3, 4], 0)], tokens={"a": 3 * BS + 1}))
        assert [len(s.block_ids) for s in meta.saves] == [3] and meta.retains == []
        w.start_load_kv(meta)
        stats = sched.hint_stats
        assert stats.applications(FETCH_ACTION, "left_to_peer") == 1
        assert stats.applications(PREFETCH_ACTION, "unknown_scope") == 1
        assert stats.applications(PREFETCH_ACTION, "queued") == 0
    finally:
        w.shutdown()
