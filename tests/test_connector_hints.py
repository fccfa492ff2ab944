"""Our vLLM connector applies a request's kv.retain hints: the scheduler plans, the worker's
store protects the blocks; a session's final request releases them (no engine: the roles)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from test_connector_scheduler import BS, FakeLookup, FakeRequest, sched_output

from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.metadata import SaveSpec, TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole


@dataclass
class HintedRequest(FakeRequest):
    kv_transfer_params: dict = field(default_factory=dict)


def _envelope(priority: int, end: int | None) -> dict:
    return {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "keep", "action_type": "kv.retain", "action_version": "1.0",
         "payload": {"scope": "s", "directives": [{"start": 0, "end": end, "priority": priority,
                                                   "duration": 3600}]}}]}


def _roles(tmp_path) -> tuple[SchedulerRole, WorkerRole]:
    """A scheduler role and one worker over CPU KV caches, a host tier and an SSD tier."""
    sched = SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=BS, lookup=FakeLookup(set()))
    cfg = {"ssd_dir": str(tmp_path / "ssd"), "host_capacity_bytes": 64 << 20, "metrics_port": None,
           "ssd_seal_idle_s": 3600}
    w = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bfloat16", block_size=BS,
                   num_kv_heads=2, head_size=8, tp_rank=0, tp_size=1, engine_key=f"t-{uuid.uuid4().hex[:8]}",
                   authkey=b"k")
    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=8, block_size=BS,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
    return sched, w


def test_retain_hints_reach_the_worker_store_and_the_final_request_releases(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        req = HintedRequest("a", list(range(4 * BS + 3)), kv_transfer_params={"kv_hints": _envelope(70, 2 * BS)})
        sched.get_num_new_matched_tokens(req, 0)
        meta = sched.build_connector_meta(sched_output({}))
        w.start_load_kv(meta)
        keys = w.keys_of(sched._reqs["a"].hashes_upto(4))
        host = w.store.retention.retention_of(0)
        assert [host.priority(k) for k in keys] == [70, 70, 0, 0]  # tokens [0, 32): the first two blocks

        final = HintedRequest("b", list(range(4 * BS + 3)), kv_transfer_params={
            "kv_hints": _envelope(70, 2 * BS), "X-Dynamo-Session-Final": True})
        sched.get_num_new_matched_tokens(final, 0)
        w.start_load_kv(sched.build_connector_meta(sched_output({})))
        sched.request_finished(final, [])
        w.start_load_kv(sched.build_connector_meta(sched_output({})))
        assert [host.priority(k) for k in keys] == [0, 0, 0, 0]
    finally:
        w.shutdown()


def test_requests_without_hints_send_nothing() -> None:
    sched = SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=BS, lookup=FakeLookup(set()))
    sched.get_num_new_matched_tokens(HintedRequest("a", list(range(3 * BS))), 0)
    sched.request_finished(SimpleNamespace(request_id="a"), [])
    assert sched.build_connector_meta(sched_output({})).retains == []


def test_a_prefetch_hint_brings_a_retained_session_back_into_the_host_tier(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        turn = HintedRequest("t1", list(range(4 * BS + 3)), kv_transfer_params={"kv_hints": _envelope(70, None)})
        sched.get_num_new_matched_tokens(turn, 0)
        hashes = sched._reqs["t1"].hashes_upto(4)
        w.start_load_kv(sched.build_connector_meta(sched_output({})))
        w.wait_for_save(TieredKVMetadata(saves=[SaveSpec("t1", [1, 2, 3, 4], hashes, 0)]))
        assert w.store.drain(10)
        owner = sched._reqs["t1"].holder  # (its tenant, scope "s")
        sched.request_finished(turn, [])
        keys = w.keys_of(hashes)
        assert w.store.demote(keys) == 0  # another holder's demote moves nothing the session holds
        assert w.store.demote(keys, holder=owner) == 4  # the session paused: its blocks went down to the SSD
        host = w.store.tiers[0]
        assert not any(host.contains(k) for k in keys)

        warm = {"protocol_version": "0.1", "message_id": "w", "actions": [
            {"action_id": "p", "action_type": "dtkv.prefetch", "action_version": "1.0", "payload": {"scope": "s"}}]}
        sched.get_num_new_matched_tokens(HintedRequest("ping", list(range(3)),
                                                       kv_transfer_params={"kv_hints": warm}), 0)
        meta = sched.build_connector_meta(sched_output({}))
        assert [len(s.token_hashes) for s in meta.retains if s.prefetch] == [4]
        w.start_load_kv(meta)
        deadline = time.monotonic() + 10
        while not all(host.contains(k) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(host.contains(k) for k in keys)
    finally:
        w.shutdown()
