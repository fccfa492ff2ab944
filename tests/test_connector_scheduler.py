"""vLLM connector scheduler role and lookup rendezvous, without an engine (fake requests)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.rendezvous import LookupClient, LookupServer, register_local, unregister_local
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole

BS = 4


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)
    prompt_embeds: object = None
    lora_request: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class FakeLookup:
    def __init__(self, known: set[bytes]) -> None:
        self.known = known
        self.calls: list[list[bytes]] = []

    def lookup(self, hashes):
        self.calls.append(list(hashes))
        n = 0
        for h in hashes:
            if h not in self.known:
                break
            n += 1
        return n, ("host",) * n

    def close(self) -> None:
        pass


def role(lookup, **cfg) -> SchedulerRole:
    """Synchronous loads unless ``load_async=True`` (tests/test_connector_async.py covers those)."""
    return SchedulerRole(TieredKVConfig.from_mapping({"load_async": False, **cfg}), model_id="m", block_size=BS,
                         lookup=lookup)


def sched_output(new=(), cached=(), tokens=None):
    new_reqs = [SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=nc) for r, ids, nc in new]
    c = list(cached)
    cached_reqs = SimpleNamespace(req_ids=[r for r, _, _ in c], resumed_req_ids=set(),
                                  new_block_ids=[(ids,) if ids else None for _, ids, _ in c],
                                  num_computed_tokens=[nc for _, _, nc in c])
    return SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                           num_scheduled_tokens=tokens or {})


def step_output(invalid=(), events=None):
    """The scheduler-side ``KVConnectorOutput`` of one step: block ids that failed to load."""
    return SimpleNamespace(invalid_block_ids=set(invalid), kv_cache_events=events)


def test_saves_full_blocks_then_restores_the_prefix() -> None:
    writer = role(FakeLookup(set()))
    req = FakeRequest("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert writer.get_num_new_matched_tokens(req, 0) == (0, False)
    writer.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 0)
    meta = writer.build_connector_meta(sched_output(new=[("a", [5, 6, 7], 0)], tokens={"a": 10}))
    assert meta.loads == [] and len(meta.saves) == 1
    save = meta.saves[0]
    assert save.block_ids == [5, 6] and save.first_index == 0 and len(save.token_hashes) == 2
    # Decode adds tokens 10, 11: block 2 becomes full; its spec carries its parent's hash first.
    req.all_token_ids += [10, 11]
    meta = writer.build_connector_meta(sched_output(cached=[("a", None, 10)], tokens={"a": 2}))
    (save2,) = meta.saves
    assert save2.block_ids == [7] and save2.first_index == 2 and save2.token_hashes[0] == save.token_hashes[1]
    stored = set(save.token_hashes) | {save2.token_hashes[1]}

    # A fresh scheduler (another process) restores those blocks for the same tokens.
    lk = FakeLookup(stored)
    reader = role(lk)
    req2 = FakeRequest("b", list(range(13)))
    assert reader.get_num_new_matched_tokens(req2, 0) == (3 * BS, False)
    reader.update_state_after_alloc(req2, SimpleNamespace(get_block_ids=lambda: ([9, 8, 3, 4],)), 3 * BS)
    meta = reader.build_connector_meta(sched_output(new=[("b", [9, 8, 3, 4], 12)], tokens={"b": 1}))
    (load,) = meta.loads
    assert load.block_ids == [9, 8, 3] and load.token_hashes == [*save.token_hashes, save2.token_hashes[1]]
    assert meta.saves == []  # loaded blocks are never saved again


def test_last_token_is_always_computed_and_local_hits_are_skipped() -> None:
    lk = FakeLookup(set())
    r = role(lk)
    req = FakeRequest("a", list(range(8)))  # exactly 2 blocks: only the first may be restored
    r.get_num_new_matched_tokens(req, 0)
    assert len(lk.calls[-1]) == 1
    req2 = FakeRequest("b", list(range(20)))
    r.get_num_new_matched_tokens(req2, 2 * BS)  # engine's own cache had 2 blocks
    assert len(lk.calls[-1]) == 2  # asks only for blocks 2 and 3 (block 4 holds the last token)


def test_tenant_and_cache_salt_change_every_hash() -> None:
    def hashes(salt: str, cache_salt: str | None = None) -> list[bytes]:
        r = role(FakeLookup(set()), tenant_salt=salt)
        req = FakeRequest("a", list(range(9)), cache_salt=cache_salt)
        r.get_num_new_matched_tokens(req, 0)
        return r._reqs["a"].hashes

    base = hashes("t1")
    assert hashes("t1") == base
    assert not set(hashes("t2")) & set(base)
    assert not set(hashes("t1", "user-7")) & set(base)


def test_min_prefix_blocks_delays_saves_until_long_enough() -> None:
    r = role(FakeLookup(set()), min_prefix_blocks=3)
    req = FakeRequest("a", list(range(9)))
    r.get_num_new_matched_tokens(req, 0)
    r.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 0)
    assert r.build_connector_meta(sched_output(new=[("a", [1, 2, 3], 0)], tokens={"a": 9})).saves == []
    req.all_token_ids += [9, 10, 11]
    (save,) = r.build_connector_meta(sched_output(cached=[("a", None, 9)], tokens={"a": 3})).saves
    assert save.block_ids == [1, 2, 3] and save.first_index == 0


def test_multimodal_requests_are_never_cached() -> None:
    lk = FakeLookup(set())
    r = role(lk)
    req = FakeRequest("a", list(range(20)), mm_features=[object()])
    assert r.get_num_new_matched_tokens(req, 0) == (0, False)
    assert lk.calls == []


def test_lookup_over_socket_and_in_process() -> None:
    key = f"test-{uuid.uuid4().hex[:8]}"
    fn = FakeLookup({b"x" * 16, b"y" * 16}).lookup
    server = LookupServer(key, fn, authkey=b"k")
    try:
        client = LookupClient(key, b"k")
        assert client.lookup([b"x" * 16, b"y" * 16, b"z" * 16]) == (2, ("host", "host"))
        client.close()
        bad = LookupClient(key, b"wrong-key")
        with pytest.raises(Exception):  # noqa: B017 - authentication failure of any kind
            bad.lookup([b"x" * 16])
    finally:
        server.close()
    assert LookupClient(key, b"k").lookup([b"x" * 16]) == (0, ())  # nobody answers: a miss
    register_local(key, fn)
    try:
        assert LookupClient(key, b"k").lookup([b"y" * 16]) == (1, ("host",))
    finally:
        unregister_local(key)


def test_lookup_socket_works_under_a_long_tmpdir(tmp_path, monkeypatch) -> None:
    """A TMPDIR whose socket path overflows sun_path (107 bytes) must not turn lookups into misses."""
    import tempfile

    from dynamo_tiered_kv.connectors.vllm.rendezvous import socket_path

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    key = f"engine-{uuid.uuid4().hex}-dp0"
    assert len(socket_path(key).encode()) <= 107
    server = LookupServer(key, FakeLookup({b"x" * 16}).lookup, authkey=b"k")
    try:
        assert LookupClient(key, b"k").lookup([b"x" * 16]) == (1, ("host",))
    finally:
        server.close()


class _FailingStore:
    """Store stub: loads fail for ``bad`` blocks; offloads are recorded."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.offloads: list[list[int]] = []

    def load(self, layout, ids, keys, timeout=None, pacer=None, decode_threads=None):
        from dynamo_tiered_kv.store.store import LoadResult

        ok = [b for b in ids if b not in self.bad]
        return LoadResult(ok, [b for b in ids if b in self.bad], ["ssd"] * len(ok))

    def submit_offload(self, layout, ids, keys, parents, first_index=0, tenant=bytes(8)):
        self.offloads.append(list(ids))
        return True


def _load_step_with_failure(r: SchedulerRole, req: FakeRequest, worker):
    """Request of 22 tokens, 3 blocks stored, blocks 11 and 12 fail to load in the first step."""
    ids = [10, 11, 12, 13, 14, 15]
    n, _ = r.get_num_new_matched_tokens(req, 0)
    assert n == 3 * BS
    r.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), n)
    meta = r.build_connector_meta(sched_output(new=[("r", ids, n)], tokens={"r": 22 - n}))
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    errors = worker.get_block_ids_with_load_errors()
    assert errors == {11, 12}
    r.update_connector_output(step_output(errors))  # vLLM hands the step's output back
    return meta


def _worker(store):
    from dynamo_tiered_kv.blocks.keys import Namespace
    from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole

    w = WorkerRole(TieredKVConfig.from_mapping({}), model_id="m", kv_dtype="bf16", block_size=BS, num_kv_heads=1,
                   head_size=1, tp_rank=0, tp_size=1, engine_key="x", authkey=b"x")
    w.store, w.layout = store, object()
    w.namespace = Namespace("m", "bf16", "FLASH_ATTN", BS, 1, 1, 1)
    return w


def test_failed_load_saves_nothing_computed_on_it_and_saves_the_recomputed_blocks() -> None:
    store = _FailingStore({11, 12})
    r, w, req = role(FakeLookup(set())), _worker(store), FakeRequest("r", list(range(22)))
    r._lookup = SimpleNamespace(lookup=lambda h: (3, ("ssd",) * 3), close=lambda: None)
    meta = _load_step_with_failure(r, req, w)
    assert meta.saves == [] and store.offloads == []  # blocks 13, 14 were computed over garbage
    # vLLM rolls num_computed_tokens back to the first failed block (index 1) and recomputes.
    meta = r.build_connector_meta(sched_output(cached=[("r", None, 1 * BS)], tokens={"r": 22 - BS}))
    (save,) = meta.saves
    assert save.block_ids == [11, 12, 13, 14] and save.first_index == 1
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert store.offloads == [[11, 12, 13, 14]]


def test_load_outcome_in_flight_delays_saves_with_async_scheduling() -> None:
    r, req = role(FakeLookup(set())), FakeRequest("r", list(range(22)))
    r._lookup = SimpleNamespace(lookup=lambda h: (3, ("ssd",) * 3), close=lambda: None)
    ids = [10, 11, 12, 13, 14, 15]
    r.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)),
                               r.get_num_new_matched_tokens(req, 0)[0])
    assert r.build_connector_meta(sched_output(new=[("r", ids, 12)], tokens={"r": 10})).saves == []
    # Next step is built while the load's step is still in flight (async scheduling): no save yet.
    req.num_in_flight_tokens = 10
    req.all_token_ids.append(99)
    assert r.build_connector_meta(sched_output(cached=[("r", None, 22)], tokens={"r": 1})).saves == []
    # The load's step came back fine; only the previous decode step is in flight.
    r.update_connector_output(step_output())
    req.num_in_flight_tokens = 1
    req.all_token_ids.append(98)
    (save,) = r.build_connector_meta(sched_output(cached=[("r", None, 23)], tokens={"r": 1})).saves
    assert save.block_ids == [13, 14, 15] and save.first_index == 3


def test_request_sharing_a_block_being_loaded_saves_nothing_that_step() -> None:
    r = role(FakeLookup(set()))
    r._lookup = SimpleNamespace(lookup=lambda h: (1, ("ssd",)), close=lambda: None)
    a, b = FakeRequest("a", list(range(9))), FakeRequest("b", list(range(9)))
    r.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)),
                               r.get_num_new_matched_tokens(a, 0)[0])
    r.get_num_new_matched_tokens(b, BS)  # the engine's prefix cache shares a's block 1 with b
    r.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([1, 4, 5],)), 0)
    meta = r.build_connector_meta(sched_output(new=[("a", [1, 2, 3], BS), ("b", [1, 4, 5], BS)],
                                               tokens={"a": 5, "b": 5}))
    assert [ld.block_ids for ld in meta.loads] == [[1]] and meta.saves == []


def _kv_caches(num_layers: int, heads: int, head_size: int) -> dict:
    from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv

    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=num_layers, num_blocks=4, block_size=BS,
                            num_kv_heads=heads, head_size=head_size)
    return {f"model.layers.{i}.attn": t for i, t in enumerate(ts)}


def _pp_worker(cfg: dict, **kw):
    from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole

    args = {"tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2, "dp_rank": 1, "num_kv_heads": 2,
            "head_size": 8, **kw}
    return WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bfloat16", block_size=BS,
                      engine_key=f"test-{uuid.uuid4().hex[:8]}", authkey=b"k", **args)


def test_worker_namespace_and_store_rank_name_the_pipeline_stage(tmp_path) -> None:
    w = _pp_worker({"ssd_dir": str(tmp_path), "host_capacity_bytes": 0})
    w.register_kv_caches(_kv_caches(2, 2, 8))
    try:
        assert (w.namespace.pp_rank, w.namespace.pp_size) == (1, 2)
        (ssd,) = w.store.tiers
        assert ssd.rank == (1 * 2 + 1) * 2 + 1  # (dp * pp_size + pp) * tp_size + tp: unique on the host
    finally:
        w.shutdown()


def test_block_record_larger_than_a_staging_slab_fails_at_startup() -> None:
    from dynamo_tiered_kv.errors import ConfigError

    w = _pp_worker({"staging_slab_bytes": 64 * 1024}, tp_size=1, pp_size=1, pp_rank=0, tp_rank=0,
                   num_kv_heads=8, head_size=128)
    with pytest.raises(ConfigError, match=r"staging_slab_bytes.*at least \d{6}"):
        w.register_kv_caches(_kv_caches(8, 8, 128))  # 8 layers x 16 KiB payload: 128 KiB and headers per record
    assert w.store is None


def _a_loads_then_b_hits_its_blocks_a_step_later(r: SchedulerRole):
    """Async scheduling: A restores 3 blocks in step N; step N+1 is built before step N's output,
    and B (same 12-token prefix) takes a local prefix hit on A's blocks 10, 11, 12."""
    r._lookup = SimpleNamespace(lookup=lambda h: (3, ("ssd",) * 3), close=lambda: None)
    a = FakeRequest("a", list(range(22)))
    a_ids = [10, 11, 12, 13, 14, 15]
    r.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: (a_ids,)),
                               r.get_num_new_matched_tokens(a, 0)[0])
    meta = r.build_connector_meta(sched_output(new=[("a", a_ids, 12)], tokens={"a": 10}))
    assert [ld.block_ids for ld in meta.loads] == [[10, 11, 12]] and meta.saves == []
    a.num_in_flight_tokens = 10  # step N in flight
    r._lookup = SimpleNamespace(lookup=lambda h: (0, ()), close=lambda: None)
    b = FakeRequest("b", list(range(12)) + list(range(100, 110)))
    b_ids = [10, 11, 12, 20, 21, 22]
    assert r.get_num_new_matched_tokens(b, 12) == (0, False)
    r.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: (b_ids,)), 0)
    a.all_token_ids.append(99)
    meta = r.build_connector_meta(sched_output(new=[("b", b_ids, 12)], cached=[("a", None, 22)],
                                               tokens={"b": 10, "a": 1}))
    assert meta.loads == [] and meta.saves == []  # B computed blocks 3, 4 over blocks of unknown outcome
    a.num_in_flight_tokens, b.num_in_flight_tokens = 11, 10
    return a, b


def test_prefix_hit_on_an_earlier_steps_load_holds_saves_until_its_outcome_is_known() -> None:
    r = role(FakeLookup(set()))
    a, b = _a_loads_then_b_hits_its_blocks_a_step_later(r)
    # Step N+2 is built before step N+1's output: nothing may be saved yet either.
    a.all_token_ids.append(98)
    b.all_token_ids.append(97)
    meta = r.build_connector_meta(sched_output(cached=[("a", None, 23), ("b", None, 22)], tokens={"a": 1, "b": 1}))
    assert meta.saves == []
    r.update_connector_output(step_output())  # step N: every block loaded
    a.all_token_ids.append(96)
    b.all_token_ids.append(95)
    meta = r.build_connector_meta(sched_output(cached=[("a", None, 24), ("b", None, 23)], tokens={"a": 1, "b": 1}))
    saves = {s.req_id: s for s in meta.saves}
    assert saves["a"].block_ids == [13, 14, 15] and saves["a"].first_index == 3
    assert saves["b"].block_ids == [20, 21, 22] and saves["b"].first_index == 3


@pytest.mark.parametrize("rolled_back", ["a", "b"])
def test_failed_load_under_a_prefix_hit_resumes_saves_only_where_vllm_recomputes(rolled_back: str) -> None:
    r = role(FakeLookup(set()))
    a, b = _a_loads_then_b_hits_its_blocks_a_step_later(r)
    r.update_connector_output(step_output({11}))  # step N: block 11 failed on some rank
    # vLLM rolls back the first running request holding block 11 to it (index 1); the other keeps
    # its position, so its KV computed over block 11 stays: it must never be saved.
    nc = {"a": 23 - 10, "b": 22} if rolled_back == "b" else {"a": 22, "b": 22}
    nc[rolled_back] = BS
    a.all_token_ids.append(98)
    b.all_token_ids.append(97)
    sched = {"a": a.num_tokens - nc["a"], "b": b.num_tokens - nc["b"]}
    meta = r.build_connector_meta(sched_output(cached=[("a", None, nc["a"]), ("b", None, nc["b"])], tokens=sched))
    (save,) = meta.saves
    assert save.req_id == rolled_back and save.first_index == 1  # from the rolled-back block on
    assert save.block_ids == ([11, 12, 13, 14, 15] if rolled_back == "a" else [11, 12, 20, 21])
    r.update_connector_output(step_output())  # step N+1
    other = b if rolled_back == "a" else a
    other.all_token_ids += [1, 2, 3, 4]
    n = other.num_tokens - 4
    meta = r.build_connector_meta(sched_output(cached=[(other.request_id, [30], n)], tokens={other.request_id: 4}))
    assert meta.saves == []  # still tainted after the outcome is known


def test_load_outcomes_holds_a_key_until_every_block_it_touched_is_known() -> None:
    from dynamo_tiered_kv.connectors.vllm.load_outcomes import LoadOutcomes

    lo = LoadOutcomes()
    lo.step_built(1, [1, 2])  # step 1 loads blocks 1, 2
    lo.started([3])  # an asynchronous load into block 3
    lo.step_built(2, [])  # step 2 loads nothing
    lo.touch("x", [1, 3, 9])
    lo.touch("y", [9])
    assert lo.settle("y") == frozenset() and len(lo) == 3
    lo.step_output({2}, 1)  # step 1 back: block 2 failed, 1 loaded
    assert lo.settle("x") is None  # block 3 is still unknown
    lo.finished([3], failed=[3])
    assert lo.settle("x") == {3} and lo.settle("x") == frozenset()  # settled once, then forgotten
    lo.step_output(set(), 2)
    assert len(lo) == 0


def test_load_outcomes_pairs_outputs_by_step_number_not_by_count(caplog) -> None:
    from dynamo_tiered_kv.connectors.vllm.load_outcomes import LoadOutcomes

    lo = LoadOutcomes()
    lo.step_built(1, [])  # a step without a forward whose output vLLM never hands back
    lo.step_built(2, [5, 6])
    lo.touch("x", [5, 6])
    lo.step_output({6}, 2)  # step 2's failure is step 2's, though step 1 never returned
    assert lo.settle("x") == {6} and len(lo) == 0
    assert not caplog.records  # a lost step that loaded nothing is no loss
    lo.step_built(3, [7])
    lo.step_built(4, [8])
    lo.touch("y", [7, 8])
    lo.step_output(set(), 4)  # outputs come in step order: step 3's never will
    assert lo.settle("y") == {7} and "no output for step 3" in caplog.text
    lo.step_output({9}, 3)  # a late or repeated answer for a step already settled changes nothing
    assert len(lo) == 0
