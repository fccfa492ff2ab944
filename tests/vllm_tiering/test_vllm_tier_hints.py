"""The vLLM secondary tier applies a request's kv.retain hints to the store, and a session's
final request releases them (real vLLM tiering manager, real SSD tier)."""

from __future__ import annotations

from pathlib import Path

from tiering_engine import Engine, keys
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import ReqContext

from dynamo_tiered_kv.connectors.common.session_flags import session_final
from dynamo_tiered_kv.connectors.vllm_tiering.key_mapping import block_keys


def _settings(tmp_path: Path) -> dict[str, object]:
    return {"ssd_dir": str(tmp_path / "ssd"), "ssd_segment_bytes": 1 << 20, "ssd_capacity_bytes": 64 << 20,
            "staging_slab_bytes": 256 << 10, "staging_slabs": 4}


def _retain(priority: int, start: int = 0, end: int | None = None) -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version="1.0", message_id="m1", actions=[KvHintAction(
        action_id="a1", action_type="kv.retain", action_version="1.0",
        payload={"scope": "s1", "directives": [{"start": start, "end": end, "priority": priority,
                                                "duration": 3600}]})])


def test_stored_chunks_get_the_retention_their_tokens_earn(tmp_path: Path) -> None:
    eng = Engine.start(_settings(tmp_path))
    try:
        chunk = eng.tier._hints.chunk_tokens
        assert chunk
        ctx = eng.new_request(ReqContext(req_id="hinted", kv_hints=_retain(60, 0, 2 * chunk)))
        ks = keys(4, tag="h")
        for i, k in enumerate(ks):
            ctx.set_offload_key_position(k, (i + 1) * chunk)
        eng.store(ks)
        eng.settle()
        cls = eng.tier.store.retention.retention_of(0)
        bks = block_keys(eng.tier.namespace, ks)
        assert [cls.priority(b) for b in bks] == [60, 60, 0, 0]  # only the chunks the range covers
        assert cls.get(bks[0]).expiry == cls.get(bks[1]).expiry is not None

        # the session's last turn: the same context and scope, flagged final by Dynamo
        final = eng.new_request(ReqContext(req_id="final", kv_hints=_retain(60, 0, 2 * chunk),
                                           kv_transfer_params={"X-Dynamo-Session-Final": True}))
        for i, k in enumerate(ks):
            final.set_offload_key_position(k, (i + 1) * chunk)
        with eng.manager.lock:
            eng.tier.on_request_finished(final)  # the manager's call into each tier
        assert [cls.priority(b) for b in bks] == [0, 0, 0, 0]  # the session's end releases its scope
    finally:
        eng.stop()


def test_session_final_flag_forms() -> None:
    assert session_final({"X-Dynamo-Session-Final": True}) and session_final({"x-dynamo-session-final": "true"})
    assert not session_final({"X-Dynamo-Session-Final": "no"}) and not session_final(None)
