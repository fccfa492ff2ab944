"""The scheduler role's hint counters reach /metrics through the workers: each step's metadata
carries what they gained since the last step that carried any, and the first worker adds it into
the ``dtkv_hint_*`` counters on its store's registry (real host and SSD tiers, CPU KV tensors)."""

from __future__ import annotations

import pickle
import uuid

import torch
from test_connector_engine_steps import PREFIX, engine, model_dir  # noqa: F401  (model_dir: fixture)
from test_connector_hints import HintedRequest, _envelope, _roles
from test_connector_scheduler import BS, FakeLookup, FakeRequest, sched_output
from vllm import SamplingParams
from vllm.v1.request import Request

from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.metadata import TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole
from dynamo_tiered_kv.hints import RETAIN_ACTION, HintStats
from dynamo_tiered_kv.hints.stats import HintCounts


def _value(w: WorkerRole, name: str, **labels: str) -> float | None:
    assert w.store is not None
    return w.store.metrics.registry.get_sample_value(name, labels)


def _step(sched, *workers: WorkerRole):
    """One engine step with nothing scheduled: the metadata reaches every worker (pickled, as
    across processes)."""
    meta = sched.build_connector_meta(sched_output({}))
    for w in workers:
        w.start_load_kv(pickle.loads(pickle.dumps(meta)))
    return meta


def _second_rank(tmp_path) -> WorkerRole:
    cfg = {"ssd_dir": str(tmp_path / "ssd1"), "host_capacity_bytes": 64 << 20, "metrics_port": None,
           "ssd_seal_idle_s": 3600}
    w = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bfloat16", block_size=BS,
                   num_kv_heads=2, head_size=8, tp_rank=1, tp_size=2, engine_key=f"t-{uuid.uuid4().hex[:8]}",
                   authkey=b"k")
    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=8, block_size=BS,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
    return w


def test_scheduler_hint_counters_are_exported_once_by_the_first_worker(tmp_path) -> None:
    sched, w0 = _roles(tmp_path)
    w1 = _second_rank(tmp_path)
    try:
        sched.get_num_new_matched_tokens(HintedRequest("bad", list(range(3 * BS)),
                                                       kv_transfer_params={"kv_hints": "junk"}), 0)
        sched.get_num_new_matched_tokens(HintedRequest("good", list(range(3 * BS)),
                                                       kv_transfer_params={"kv_hints": _envelope(70, BS)}), 0)
        meta = _step(sched, w0, w1)
        assert meta.loads == [] and meta.saves == []  # the counters travel without other work
        assert _value(w0, "dtkv_hint_envelopes_total", outcome="malformed") == 1
        assert _value(w0, "dtkv_hint_envelopes_total", outcome="ok") == 1
        assert _value(w0, "dtkv_hint_actions_total", action=RETAIN_ACTION, outcome="accepted") == 1
        # the second TP rank got the same metadata and exports none of it: a sum over ranks is exact
        assert _value(w1, "dtkv_hint_envelopes_total", outcome="malformed") is None

        assert _step(sched, w0, w1).hint_counts is None  # no new hints: nothing sent, nothing added
        assert _value(w0, "dtkv_hint_envelopes_total", outcome="malformed") == 1
        assert _value(w0, "dtkv_hint_actions_total", action=RETAIN_ACTION, outcome="accepted") == 1

        sched.get_num_new_matched_tokens(HintedRequest("bad2", list(range(3 * BS)),
                                                       kv_transfer_params={"kv_hints": ["junk"]}), 0)
        _step(sched, w0, w1)
        assert _value(w0, "dtkv_hint_envelopes_total", outcome="malformed") == 2
        assert _value(w0, "dtkv_hint_envelopes_total", outcome="ok") == 1
    finally:
        w0.shutdown()
        w1.shutdown()


def test_malformed_or_absent_counts_are_ignored_on_the_engine_thread(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        sched.hint_stats.envelope("ok")
        good = _step(sched, w).hint_counts
        assert _value(w, "dtkv_hint_envelopes_total", outcome="ok") == 1
        for bad in ("junk", HintCounts((("envelopes", ("ok",), -5),)), HintCounts((("envelopes", (), 1),)),
                    HintCounts((("nope", ("x",), 1),)), HintCounts((("envelopes", ("ok",), True),)),
                    HintCounts([("envelopes", ("ok",), 1)])):  # type: ignore[arg-type]
            meta = sched.build_connector_meta(sched_output({}))
            meta.hint_counts = bad  # type: ignore[assignment]
            w.start_load_kv(meta)
        legacy = sched.build_connector_meta(sched_output({}))
        del legacy.hint_counts  # metadata without the field
        w.start_load_kv(legacy)
        assert _value(w, "dtkv_hint_envelopes_total", outcome="ok") == 1
        assert good is not None and w.hint_stats.add(good)  # a well-formed one is still added
        assert _value(w, "dtkv_hint_envelopes_total", outcome="ok") == 2
    finally:
        w.shutdown()


def test_since_is_what_grew_and_add_sums_it() -> None:
    stats = HintStats()
    stats.envelope("ok")
    stats.rejected(RETAIN_ACTION, "directives")
    first = stats.counts()
    stats.envelope("ok")
    stats.truncated_directives(3)
    stats.applied("kv.fetch", "left_to_peer")
    grown = stats.counts().since(first)
    assert sorted(grown.entries) == [("applied", ("kv.fetch", "left_to_peer"), 1), ("envelopes", ("ok",), 1),
                                     ("truncated", (), 3)]
    assert not stats.counts().since(stats.counts())

    other = HintStats()
    assert other.add(first) and other.add(grown)
    assert sorted(other.counts().entries) == sorted(stats.counts().entries)


def test_requests_without_hints_send_no_counts() -> None:
    sched = SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=BS, lookup=FakeLookup(set()))
    sched.get_num_new_matched_tokens(FakeRequest("a", list(range(3 * BS))), 0)
    assert sched.build_connector_meta(sched_output({})).hint_counts is None


def test_through_vllms_scheduler_every_hint_is_counted_once(model_dir) -> None:  # noqa: F811
    """vLLM 0.32's own ``Scheduler`` and connector hooks, steps without a forward included."""
    with engine(model_dir, load_async=False) as e:
        def submit(req_id: str, hints: object) -> None:
            params = SamplingParams(max_tokens=3, ignore_eos=True,
                                    extra_args={"kv_transfer_params": {"kv_hints": hints}})
            e.sched.add_request(Request(req_id, [*PREFIX, len(e.metas)], params, None, block_hasher=e._hasher))

        submit("bad", "junk")
        submit("good", _envelope(70, 2 * BS))
        e.run(lambda: not e.sched.has_requests())
        for _ in range(3):
            e.step()  # idle steps: nothing new to send
        submit("bad2", ["junk"])
        e.run(lambda: not e.sched.has_requests())
        sent = [m.hint_counts for m in e.metas if isinstance(m, TieredKVMetadata) and m.hint_counts]
        assert len(sent) == 2
        v = e.store.metrics.registry.get_sample_value
        assert v("dtkv_hint_envelopes_total", {"outcome": "malformed"}) == 2
        assert v("dtkv_hint_envelopes_total", {"outcome": "ok"}) == 1
        assert v("dtkv_hint_actions_total", {"action": RETAIN_ACTION, "outcome": "accepted"}) == 1
