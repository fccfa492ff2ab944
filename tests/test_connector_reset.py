"""Weight updates (``reset_cache``) and LoRA-scoped KV events, without an engine."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import torch
from test_connector_scheduler import BS, FakeLookup, FakeRequest, sched_output

from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.metadata import SaveSpec, TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole


def _role(**kw) -> SchedulerRole:
    return SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=BS, lookup=FakeLookup(set()),
                         **kw)


def _alloc(r: SchedulerRole, req: FakeRequest, ids: list[int]) -> None:
    r.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)),
                               r.get_num_new_matched_tokens(req, 0)[0])


def test_reset_changes_every_later_key_and_stops_requests_alive_across_it() -> None:
    r = _role()
    before = r._state(FakeRequest("a", list(range(9)))).hashes_upto(2)
    alive = FakeRequest("b", list(range(9)))
    _alloc(r, alive, [1, 2, 3])
    assert r.reset_cache() is True
    # the same tokens after the reset: other keys, so nothing stored before can be found
    assert r._state(FakeRequest("c", list(range(9)))).hashes_upto(2) != before
    # the request alive across the reset computed (part of) its KV with the old weights
    meta = r.build_connector_meta(sched_output(new=[("b", [1, 2, 3], 0)], tokens={"b": 9}))
    assert meta.saves == [] and meta.reset_cache is True
    assert r.get_num_new_matched_tokens(alive, 0) == (0, False)
    # the reset is announced once; a new request saves under the new keys
    fresh = FakeRequest("d", list(range(9)))
    _alloc(r, fresh, [4, 5, 6])
    meta = r.build_connector_meta(sched_output(new=[("d", [4, 5, 6], 0)], tokens={"d": 9}))
    assert meta.reset_cache is False
    assert [s.token_hashes for s in meta.saves] == [r._reqs["d"].hashes_upto(2)]
    assert meta.saves[0].token_hashes != before


def test_two_resets_never_reuse_an_epoch() -> None:
    r = _role()
    seen = set()
    for _ in range(3):
        r.reset_cache()
        seen.add(tuple(r._state(FakeRequest(uuid.uuid4().hex, list(range(5)))).hashes_upto(1)))
    assert len(seen) == 3


def test_kv_events_name_the_lora_adapter() -> None:
    r = _role(kv_events=True)
    req = FakeRequest("a", list(range(9)), lora_request=SimpleNamespace(lora_name="sql", lora_int_id=7))
    _alloc(r, req, [1, 2, 3])
    meta = r.build_connector_meta(sched_output(new=[("a", [1, 2, 3], 0)], tokens={"a": 9}))
    (spec,) = meta.saves
    assert (spec.lora_id, spec.lora_name) == (7, "sql")

    from dynamo_tiered_kv.connectors.vllm.events import block_stored

    ev = block_stored(spec.token_hashes, None, spec.token_ids, BS, medium="CPU_PINNED", lora_id=spec.lora_id,
                      lora_name=spec.lora_name)
    assert (ev.lora_id, ev.lora_name) == (7, "sql")


def test_worker_drops_host_and_ssd_blocks_on_reset(tmp_path) -> None:
    cfg = {"ssd_dir": str(tmp_path / "ssd"), "host_capacity_bytes": 64 << 20, "metrics_port": None,
           "ssd_seal_idle_s": 3600}
    w = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bfloat16", block_size=BS,
                   num_kv_heads=2, head_size=8, tp_rank=0, tp_size=1, engine_key=f"t-{uuid.uuid4().hex[:8]}",
                   authkey=b"k")
    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=8, block_size=BS,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
    try:
        hashes = [bytes([i]) * 16 for i in range(3)]
        w.wait_for_save(TieredKVMetadata(saves=[SaveSpec("a", [1, 2, 3], hashes, 0)]))
        assert w.store.drain(10)
        assert w.lookup(hashes)[0] == 3
        assert all(t.usage().num_blocks == 3 for t in w.store.tiers)
        w.start_load_kv(TieredKVMetadata(reset_cache=True))
        assert w.store.drain(10)
        deadline = time.monotonic() + 5
        while w.lookup(hashes)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.lookup(hashes)[0] == 0
        assert [t.usage().num_blocks for t in w.store.tiers] == [0, 0]
        # and the SSD tier remembers it across a restart (tombstones)
        w.shutdown()
        w2 = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bfloat16", block_size=BS,
                        num_kv_heads=2, head_size=8, tp_rank=0, tp_size=1,
                        engine_key=f"t-{uuid.uuid4().hex[:8]}", authkey=b"k")
        w2.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
        try:
            assert w2.lookup(hashes)[0] == 0
        finally:
            w2.shutdown()
    finally:
        w.shutdown()



def test_cache_reset_keep_leaves_stored_kv_in_use() -> None:
    """vLLM resets connectors on every sleep/pause with clear_cache; ``keep`` is for weights that
    never change in place: keys stay the same and nothing is dropped."""
    r = SchedulerRole(TieredKVConfig.from_mapping({"cache_reset": "keep"}), model_id="m", block_size=BS,
                      lookup=FakeLookup(set()))
    before = r._state(FakeRequest("a", list(range(9)))).hashes_upto(2)
    assert r.reset_cache() is True
    assert r._state(FakeRequest("c", list(range(9)))).hashes_upto(2) == before
    meta = r.build_connector_meta(sched_output())
    assert meta.reset_cache is False
