"""Asynchronous onboarding (``load_async``): scheduler state machine and worker restore threads,
without an engine. vLLM's side is simulated the way 0.32's scheduler drives it: the request waits
in WAITING_FOR_REMOTE_KVS (not scheduled) until every worker reported it in ``finished_recving``,
failed blocks arrive as ``invalid_block_ids`` up to that step, and it is then scheduled as a new
request rolled back to its first failed block."""

from __future__ import annotations

import os
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch
from test_connector_scheduler import BS, FakeLookup, FakeRequest, sched_output

from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.metadata import LoadSpec, SaveSpec, TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.onboard import Onboarder
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole
from dynamo_tiered_kv.store.store import LoadResult

IDS = [10, 11, 12, 13, 14, 15]  # engine blocks of a 22-token request: 3 restorable, 3 computed


def _role(hit_blocks: int = 3, sync_max: int = 0, **cfg) -> SchedulerRole:
    """``sync_max``: the role's small-restore-on-an-idle-engine threshold (0 here: always async)."""
    r = SchedulerRole(TieredKVConfig.from_mapping(cfg), model_id="m", block_size=BS, lookup=FakeLookup(set()))
    r.sync_restore_max_tokens = sync_max
    r._lookup = SimpleNamespace(lookup=lambda h: (min(hit_blocks, len(h)), ("ssd",) * hit_blocks),
                                close=lambda: None)
    return r


def _out(invalid=(), finished=()):
    return SimpleNamespace(invalid_block_ids=set(invalid), finished_recving=set(finished) or None,
                           kv_cache_events=None)


def _admit(r: SchedulerRole, req: FakeRequest, ids=IDS, local: int = 0) -> LoadSpec:
    n, is_async = r.get_num_new_matched_tokens(req, local)
    assert is_async and n > 0
    r.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), n)
    meta = r.build_connector_meta(sched_output())  # the waiting request is not scheduled
    (spec,) = meta.loads
    assert spec.is_async and meta.saves == []
    return spec


def test_load_scheduled_then_finished_then_saves_resume() -> None:
    r, req = _role(), FakeRequest("r", list(range(22)))
    spec = _admit(r, req)
    assert spec.block_ids == [10, 11, 12]
    assert len(r._outcomes) == 3  # outcome unknown while the workers restore
    # Steps go by while it restores: no second load is offered, nothing is saved.
    r.update_connector_output(_out())
    assert r.get_num_new_matched_tokens(req, 0) == (0, False)
    assert r.build_connector_meta(sched_output()).loads == []
    r.update_connector_output(_out(finished={"r"}))
    assert len(r._outcomes) == 0
    # vLLM caches blocks 0-2 and schedules it from token 12: blocks 3, 4 become full and are saved.
    (save,) = r.build_connector_meta(sched_output(new=[("r", IDS, 12)], tokens={"r": 10})).saves
    assert save.block_ids == [13, 14] and save.first_index == 3


def test_failed_blocks_reported_by_any_rank_before_the_finish_are_recomputed_and_saved() -> None:
    r, req = _role(), FakeRequest("r", list(range(22)))
    _admit(r, req)
    # TP rank 1 finished first and reported block 12 failed; rank 0 finishes a step later with 11.
    r.update_connector_output(_out(invalid={12}))
    r.update_connector_output(_out(invalid={11}, finished={"r"}))
    # vLLM rolled it back to block 1 (the first failed): blocks 1..4 are recomputed and stored.
    (save,) = r.build_connector_meta(sched_output(new=[("r", IDS, BS)], tokens={"r": 22 - BS})).saves
    assert save.block_ids == [11, 12, 13, 14] and save.first_index == 1


def test_a_load_that_failed_from_its_first_block_is_not_offered_again() -> None:
    r, req = _role(), FakeRequest("r", list(range(22)))
    _admit(r, req)
    r.update_connector_output(_out(invalid={10, 11, 12}, finished={"r"}))
    # Nothing valid: vLLM frees the blocks and asks again; the store would offer the same blocks.
    assert r.get_num_new_matched_tokens(req, 0) == (0, False)
    r.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24, 25],)), 0)
    (save,) = r.build_connector_meta(sched_output(new=[("r", [20, 21, 22, 23, 24, 25], 0)],
                                                  tokens={"r": 22})).saves
    assert save.block_ids == [20, 21, 22, 23, 24] and save.first_index == 0


def test_abort_while_loading_keeps_tracking_until_the_workers_report() -> None:
    r, req = _role(), FakeRequest("r", list(range(22)))
    _admit(r, req)
    # vLLM's finish_requests delays the free of a WAITING_FOR_REMOTE_KVS request itself.
    assert r.request_finished(req, IDS) == (False, None)
    assert len(r._outcomes) == 3  # the blocks are still being written by a worker
    r.update_connector_output(_out(finished={"r"}))
    assert len(r._outcomes) == 0 and r._async == {}


def test_sync_mode_still_loads_in_step() -> None:
    r, req = _role(load_async=False), FakeRequest("r", list(range(22)))
    assert r.get_num_new_matched_tokens(req, 0) == (12, False)


def _alloc(r: SchedulerRole, req: FakeRequest, n: int, ids=IDS) -> None:
    r.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), n)


def test_small_restore_on_an_idle_engine_is_synchronous_in_the_step_that_schedules_it() -> None:
    r, req = _role(sync_max=12), FakeRequest("r", list(range(22)))
    assert r.get_num_new_matched_tokens(req, 0) == (12, False)  # 12 tokens, nothing else alive
    _alloc(r, req, 12)
    meta = r.build_connector_meta(sched_output(new=[("r", IDS, 12)], tokens={"r": 10}))
    (spec,) = meta.loads
    assert not spec.is_async and spec.block_ids == IDS[:3]


def test_restore_above_the_threshold_or_with_other_requests_alive_stays_async() -> None:
    r, req = _role(sync_max=8), FakeRequest("r", list(range(22)))
    assert r.get_num_new_matched_tokens(req, 0) == (12, True)  # larger than the threshold
    r = _role(sync_max=12)
    other = FakeRequest("d", list(range(4)))  # one block, computed (the last token always is)
    assert r.get_num_new_matched_tokens(other, 0) == (0, False)  # alive (running), nothing to load
    req = FakeRequest("r", list(range(22)))
    assert r.get_num_new_matched_tokens(req, 0) == (12, True)  # the engine is busy: async
    r.request_finished(other, [])
    assert r.get_num_new_matched_tokens(req, 0) == (12, False)  # alone again: sync
    # an async restore in flight (its request finished meanwhile counts too) keeps the next one async
    r2, a, b = _role(sync_max=12), FakeRequest("a", list(range(22))), FakeRequest("b", list(range(22)))
    r2.sync_restore_max_tokens = 0
    _admit(r2, a)
    r2.request_finished(a, IDS)
    r2.sync_restore_max_tokens = 12
    assert r2.get_num_new_matched_tokens(b, 0) == (12, True)
    r2.update_connector_output(_out(finished={"a"}))
    assert r2.get_num_new_matched_tokens(b, 0) == (12, False)


def test_load_async_off_is_always_synchronous_whatever_the_size() -> None:
    r = _role(sync_max=4, load_async=False)
    assert r.get_num_new_matched_tokens(FakeRequest("r", list(range(22))), 0) == (12, False)


# --- worker ---------------------------------------------------------------------------------------
class _GatedStore:
    """A store whose loads block until ``gate`` is set (or fail at their timeout, like
    ``TieredStore.load``); records when each load returned."""

    def __init__(self, delay: float | None = None) -> None:
        self.gate = threading.Event()
        self.delay = delay
        self.calls: list[tuple[list[int], float]] = []
        self.returned: set[int] = set()  # first block id of each load that returned

    def load(self, layout, ids, keys, timeout=None, pacer=None, decode_threads=None):
        self.calls.append((list(ids), timeout))
        if self.delay is not None:
            ok = timeout >= self.delay
            time.sleep(min(self.delay, timeout))
        else:
            ok = self.gate.wait(timeout)
        self.returned.add(ids[0])
        if not ok:
            return LoadResult([], list(ids), [])
        return LoadResult(list(ids), [], ["ssd"] * len(ids))

    def close(self) -> None:
        self.gate.set()


def _worker(store, **cfg) -> WorkerRole:
    from dynamo_tiered_kv.blocks.keys import Namespace

    w = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bf16", block_size=BS,
                   num_kv_heads=1, head_size=1, tp_rank=0, tp_size=1, engine_key="x", authkey=b"x")
    w.store, w.layout = store, object()
    w.namespace = Namespace("m", "bf16", "FLASH_ATTN", BS, 1, 1, 1)
    return w


def _spec(req_id: str, ids: list[int]) -> LoadSpec:
    return LoadSpec(req_id, ids, [bytes([i % 256]) * 16 for i in ids], is_async=True)


def _finished(w: WorkerRole, timeout: float = 5.0, finished_req_ids: set[str] | None = None) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = w.get_finished(finished_req_ids or set())
        if done:
            return done
        time.sleep(0.01)
    return set()


def test_engine_thread_never_waits_on_a_restore_and_get_finished_reports_it() -> None:
    store = _GatedStore()
    w = _worker(store)
    t0 = time.monotonic()
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [1, 2, 3])]))
    w.wait_for_save(TieredKVMetadata())
    assert w.get_finished(set()) == set() and w.get_block_ids_with_load_errors() == set()
    assert time.monotonic() - t0 < 0.2  # the step went on while the store is still reading
    store.gate.set()
    assert _finished(w) == {"r"}
    assert w.get_block_ids_with_load_errors() == set() and w.served["r"] == ["ssd"] * 3
    assert w.get_finished(set()) == set()  # reported once
    w.shutdown()


def test_abort_while_loading_reports_only_after_the_thread_stopped_writing() -> None:
    store = _GatedStore()
    w = _worker(store)
    w._onboard = Onboarder(w._restore, 30.0, threads=1)  # "q" queues behind "r"
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [1, 2]), _spec("q", [5, 6])]))
    time.sleep(0.05)
    # vLLM aborted both: finished_req_ids arrive while "r" is mid-restore.
    assert w.get_finished({"r", "q"}) == set()  # its blocks stay held: our thread may still scatter
    time.sleep(0.1)
    assert w.get_finished(set()) == set()
    store.gate.set()
    assert _finished(w, finished_req_ids=set()) | _finished(w, 0.5) == {"r", "q"}
    assert 1 in store.returned  # reported only after the load returned
    assert [ids for ids, _ in store.calls] == [[1, 2]]  # the queued restore of "q" never ran
    w.shutdown()


def test_one_deadline_per_restore_from_its_submission() -> None:
    store = _GatedStore(delay=0.25)
    w = _worker(store, load_timeout_s=0.4)
    w._onboard = Onboarder(w._restore, 0.4, threads=1)
    w.start_load_kv(TieredKVMetadata(loads=[_spec("a", [1, 2]), _spec("b", [3, 4])]))
    done = _finished(w) | _finished(w, 1.0)
    assert done == {"a", "b"}
    # "a" had its whole 0.4 s; "b" waited 0.25 s in the queue and had only what was left: it missed.
    assert store.calls[0][1] > 0.35 and store.calls[1][1] < 0.2
    assert w.get_block_ids_with_load_errors() == {3, 4}
    w.shutdown()


def test_a_restore_past_its_deadline_is_reported_failed() -> None:
    store = _GatedStore()  # never opens: the load ends at its timeout
    w = _worker(store, load_timeout_s=0.2)
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [7, 8, 9])]))
    assert _finished(w, 2.0) == {"r"}
    assert w.get_block_ids_with_load_errors() == {7, 8, 9}
    assert store.calls[0][1] <= 0.2
    w.shutdown()


def test_reset_while_restoring_fails_every_block() -> None:
    store = _GatedStore()
    w = _worker(store)
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [1, 2])]))
    w.store = SimpleNamespace(load=store.load, drop_local=lambda: None, close=store.close)
    w.start_load_kv(TieredKVMetadata(reset_cache=True))
    store.gate.set()
    assert _finished(w) == {"r"}
    assert w.get_block_ids_with_load_errors() == {1, 2}  # loaded, but with the old weights' KV
    w.shutdown()


def test_no_store_reports_the_restore_failed_at_once() -> None:
    w = _worker(None)
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [1, 2])]))
    assert w.get_finished(set()) == {"r"} and w.get_block_ids_with_load_errors() == {1, 2}


def test_idle_step_metadata_says_so_only_when_nothing_is_scheduled() -> None:
    r, req = _role(), FakeRequest("r", list(range(22)))
    _admit(r, req)
    assert r.build_connector_meta(sched_output()).idle
    other = FakeRequest("d", list(range(8)))
    r.get_num_new_matched_tokens(other, 0)
    assert not r.build_connector_meta(sched_output(new=[("d", [20], 0)], tokens={"d": 8})).idle


def test_idle_step_waits_for_a_restore_to_end_but_no_longer_than_the_cap(monkeypatch) -> None:
    from dynamo_tiered_kv.connectors.vllm import worker

    monkeypatch.setattr(worker, "IDLE_STEP_WAIT_S", 0.3)  # long enough to tell apart on a loaded VM
    store = _GatedStore()
    w = _worker(store)
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [1, 2])]))
    t0 = time.monotonic()
    assert w.get_finished(set()) == set()  # a busy step never waits
    assert w.get_finished(set(), idle=True) == set()  # nothing ended: back after the cap
    assert 0.27 <= time.monotonic() - t0 < 2.0
    monkeypatch.setattr(worker, "IDLE_STEP_WAIT_S", 30.0)
    threading.Timer(0.05, store.gate.set).start()
    t0 = time.monotonic()
    # The restore ends during the wait: this very step reports it, long before the cap.
    assert w.get_finished(set(), idle=True) == {"r"}
    assert time.monotonic() - t0 < 10.0
    w.shutdown()


def test_connector_get_finished_shape() -> None:
    from dynamo_tiered_kv.connectors.vllm.connector import TieredKVConnector

    c = TieredKVConnector.__new__(TieredKVConnector)
    c._scheduler, c._worker = None, None
    assert c.get_finished(set()) == (None, None)


def _registered_worker(cfg: dict, kind: str) -> tuple[WorkerRole, list[torch.Tensor]]:
    """A worker with a real store, registered over random KV caches of layout ``kind`` on the CPU."""
    from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv

    w = WorkerRole(TieredKVConfig.from_mapping({"metrics_port": None, **cfg}), model_id="m", kv_dtype="bfloat16",
                   block_size=BS, num_kv_heads=2, head_size=8, tp_rank=0, tp_size=1,
                   engine_key=f"t-{uuid.uuid4().hex[:8]}", authkey=b"k")
    caches = allocate_engine_kv(EngineLayoutKind[kind], num_layers=2, num_blocks=8, block_size=BS,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    for t in caches:
        t.copy_(torch.randn_like(t))
    w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
    return w, caches


def test_real_store_async_restore_matches_and_records_engine_wait(tmp_path) -> None:
    w, caches = _registered_worker({"host_capacity_bytes": 64 << 20}, "FLASH_ATTN")
    try:
        hashes = [bytes([i]) * 16 for i in range(3)]
        w.wait_for_save(TieredKVMetadata(saves=[SaveSpec("a", [1, 2, 3], hashes, 0)]))
        assert w.store.drain(10)
        want = [t[:, 1:4].clone() if t.shape[0] == 2 else t[1:4].clone() for t in caches]
        w.start_load_kv(TieredKVMetadata(loads=[LoadSpec("b", [5, 6, 7], hashes, is_async=True)]))
        assert _finished(w) == {"b"} and w.get_block_ids_with_load_errors() == set()
        got = [t[:, 5:8] if t.shape[0] == 2 else t[5:8] for t in caches]
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert w.store.metrics.value("restore_stage_seconds_count", stage="engine_wait", tier="all") == 1
    finally:
        w.shutdown()


@pytest.mark.parametrize("load_async", [True, False])
def test_config_flag_selects_the_mode(load_async: bool) -> None:
    r, req = _role(load_async=load_async), FakeRequest("r", list(range(22)))
    assert r.get_num_new_matched_tokens(req, 0) == (12, load_async)


@pytest.mark.parametrize("share", [0.2, 0.0])
def test_cpu_restores_are_paced_by_the_engine_steps(share: float) -> None:
    from dynamo_tiered_kv.policy.pacing import StepShare

    w, _ = _registered_worker({"host_capacity_bytes": 16 << 20, "restore_cpu_share": share}, "VLLM_CPU")
    try:
        pacer = w._pacer
        assert (pacer is None) if share == 0 else isinstance(pacer, StepShare) and pacer.share == share
        seen: list[object] = []
        real_load = w.store.load
        w.store.load = lambda *a, **kw: (seen.append(kw.get("pacer")), real_load(*a, **kw))[1]
        w.start_load_kv(TieredKVMetadata(idle=False, loads=[LoadSpec("b", [5], [b"h" * 16], is_async=True)]))
        assert _finished(w) == {"b"}
        assert seen == [pacer]  # async restores carry the pacer; a miss here, so block 5 failed
        if pacer is not None:
            assert not pacer._free  # the step ran a forward: restores are limited
            w.start_load_kv(TieredKVMetadata(idle=True))
            assert pacer._free
    finally:
        w.shutdown()


def test_restore_report_counts_the_steps_it_was_pending_and_sync_loads_report_their_wait() -> None:
    store = _GatedStore()
    w = _worker(store)
    seen = []
    note = w._note_restored
    w._note_restored = lambda r: (seen.append(r), note(r))
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [1, 2])]))
    assert w.get_finished(set()) == set() and w.get_finished(set()) == set()  # two steps pending
    store.gate.set()
    assert _finished(w) == {"r"}
    (r,) = seen
    assert not r.sync and r.steps >= 2 and r.engine_wait_s >= r.load_s >= 0
    # a synchronous load (small restore on an idle engine) reports its wait in the step it ran
    spec = LoadSpec("s", [3, 4], [b"\x03" * 16, b"\x04" * 16], is_async=False)
    w.start_load_kv(TieredKVMetadata(loads=[spec]))
    assert w.get_finished(set()) == set()  # never reported through finished_recving
    r = seen[-1]
    assert r.req_id == "s" and r.sync and r.steps == 0 and r.engine_wait_s == r.load_s > 0
    assert w.served["s"] == ["ssd", "ssd"] and w.get_block_ids_with_load_errors() == set()
    w.shutdown()


@pytest.mark.parametrize(("kind", "omp"), [("VLLM_CPU", 1), ("VLLM_CPU", 64), ("FLASH_ATTN", 64)])
def test_sync_loads_on_a_cpu_engine_decode_on_the_cores_its_openmp_team_leaves_free(
        kind: str, omp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synchronous load runs on the engine's thread: on a CPU layout it is limited to the cores
    torch's team leaves free (spinning workers own the rest); async restores keep the store's choice."""
    from dynamo_tiered_kv.connectors.vllm import cpu_threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: omp)
    w, _ = _registered_worker({"host_capacity_bytes": 16 << 20}, kind)
    try:
        cpus = len(os.sched_getaffinity(0))
        seen: list[object] = []
        real_load = w.store.load
        w.store.load = lambda *a, **kw: (seen.append(kw.get("decode_threads")), real_load(*a, **kw))[1]
        w.start_load_kv(TieredKVMetadata(loads=[LoadSpec("s", [5], [b"h" * 16], is_async=False)]))
        w.start_load_kv(TieredKVMetadata(loads=[LoadSpec("a", [6], [b"g" * 16], is_async=True)]))
        assert _finished(w) == {"a"}
        want = cpu_threads.sync_decode_threads(omp, cpus, {})  # both layouts live in host memory here
        assert seen == [want, None] and want == (cpus if omp == 1 else 1)
    finally:
        w.shutdown()
