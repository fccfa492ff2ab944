"""Session hints in the vLLM secondary tier, driven through vLLM 0.33's own tiering manager over
a real SSD tier and a real object tier (a local directory, and moto S3): ``dtkv.prefetch``
brings a retained session's chunks from the objects up to the SSD before the next turn loads
them, ``covers_output`` protects the generated chunks, ``kv.fetch`` is counted and harmless."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
from infra.s3util import S3Server, unique_bucket
from tiering_engine import Engine, keys, payload
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

from dynamo_tiered_kv.connectors.vllm_tiering.key_mapping import block_keys
from dynamo_tiered_kv.hints import FETCH_ACTION, PREFETCH_ACTION

pytest_plugins = ["infra.fixtures_s3"]

HIT = LookupResult.HIT
CHUNK = 16  # tokens per chunk in tiering_engine's config (16-token blocks, one block a chunk)


def _envelope(*actions: tuple[str, dict[str, Any]]) -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version="1.0", message_id="m", actions=[
        KvHintAction(action_id=f"a{i}", action_type=kind, action_version="1.0", payload=payload)
        for i, (kind, payload) in enumerate(actions)])


def _retain(scope: str, *directives: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "kv.retain", {"scope": scope, "directives": list(directives)}


def _prefetch(scope: str, **span: int) -> tuple[str, dict[str, Any]]:
    return "dtkv.prefetch", {"scope": scope, **span}


def _request(eng: Engine, req_id: str, hints: KvHintsEnvelope, ks: list[OffloadKey], first: int = 0) -> ReqContext:
    """A new request whose chunks ``ks`` are chunks ``first...`` of its tokens, keyed before the tier
    sees it, as vLLM's connector keys a prompt's chunks at admission."""
    ctx = eng.new_request(ReqContext(req_id=req_id, kv_hints=hints))
    for i, k in enumerate(ks):
        ctx.set_offload_key_position(k, (first + i + 1) * CHUNK)
    return ctx


@pytest.fixture(params=["dir", "moto_s3"])
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    if request.param == "dir":
        return {"object_url": (tmp_path / "obj").as_uri()}
    server: S3Server = request.getfixturevalue(request.param)
    bucket = unique_bucket("vp")
    boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                 aws_secret_access_key=server.secret_key, region_name="us-east-1").create_bucket(Bucket=bucket)
    return {"object_url": f"s3://{bucket}/kv", "s3_endpoint_url": server.endpoint, "s3_access_key": server.access_key,
            "s3_secret_key": server.secret_key}


def _settings(tmp_path: Path, objects: dict[str, object] | None = None, ssd: bool = True) -> dict[str, object]:
    out: dict[str, object] = {"staging_slab_bytes": 256 << 10, "staging_slabs": 4, **(objects or {})}
    if ssd:
        out.update(ssd_dir=str(tmp_path / "ssd"), ssd_segment_bytes=1 << 20, ssd_capacity_bytes=64 << 20)
    return out


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


@pytest.fixture
def session(tmp_path: Path, objects: dict[str, object]) -> Iterator[tuple[Engine, list[OffloadKey]]]:
    """Turn 1 of session "chat" retained 6 chunks; they were flushed to the object tier and have
    since left the SSD and vLLM's CPU tier: only the objects hold them."""
    eng = Engine.start(_settings(tmp_path, objects))
    try:
        _wait(lambda: eng.tier.store.tiers[-1].index_ready, "object index not ready")
        ks = keys(6, tag="chat")
        turn = _request(eng, "t1", _envelope(_retain("chat", {"start": 0, "end": None, "priority": 60,
                                                               "duration": 3600})), ks)
        eng.store(ks)
        eng.settle()
        with eng.manager.lock:
            eng.manager.on_request_finished(turn)  # not the session's last turn: its scope stays known
        eng.tier.store.persist(30)  # seal the segment; the flusher uploads it
        ssd, obj = eng.tier.store.tiers
        bks = block_keys(eng.tier.namespace, ks)
        assert all(obj.contains(b) for b in bks)
        eng.tier.store.drop_local()  # the SSD loses them (what eviction does to an unprotected chunk)
        _wait(lambda: not any(ssd.contains(b) for b in bks), "SSD still holds the chunks")
        eng.evict_primary()
        yield eng, ks
    finally:
        eng.stop()


def test_prefetch_brings_a_session_up_to_the_ssd_before_its_loads(session: tuple[Engine, list[OffloadKey]]) -> None:
    eng, ks = session
    ssd = eng.tier.store.tiers[0]
    bks = block_keys(eng.tier.namespace, ks)
    _request(eng, "t2", _envelope(_prefetch("chat")), ks)
    # on_new_request only queued it; nothing has looked the chunks up or loaded them yet
    _wait(lambda: all(ssd.contains(b) for b in bks), "prefetch did not bring the chunks to the SSD")
    assert eng.tier._hints.stats.applications(PREFETCH_ACTION, "queued") == 1
    assert eng.tier.store.retention.prefetch_stats.blocks == 6
    assert eng.lookup(ks) == [HIT] * 6
    assert all(np.array_equal(eng.read(k), payload(k)) for k in ks)
    hits = eng.tier.store.metrics.registry.get_sample_value
    assert hits("dtkv_tier_hits_total", {"tier": "ssd"}) == 6  # every load came from the SSD
    assert not hits("dtkv_tier_hits_total", {"tier": "object"})


def test_prefetch_honours_the_token_range(session: tuple[Engine, list[OffloadKey]]) -> None:
    eng, ks = session
    ssd = eng.tier.store.tiers[0]
    bks = block_keys(eng.tier.namespace, ks)
    # tokens [20, 70): chunks 1-3 hold them whole or from their start; chunk 4 (64-80) ends past 70
    _request(eng, "t2", _envelope(_prefetch("chat", start=20, end=70)), ks)
    _wait(lambda: all(ssd.contains(b) for b in bks[1:4]), "prefetch did not bring chunks 1-3")
    eng.tier.store.drain(10)
    assert eng.tier.store.retention.prefetch_stats.blocks == 3
    assert [ssd.contains(b) for b in bks] == [False, True, True, True, False, False]


def test_a_prefetch_for_an_unknown_session_or_without_an_ssd_is_counted(tmp_path: Path) -> None:
    objects = {"object_url": (tmp_path / "obj").as_uri()}
    for ssd, result in ((True, "unknown_scope"), (False, "no_target")):
        eng = Engine.start(_settings(tmp_path / result, objects, ssd=ssd))
        try:
            ks = keys(3, tag=result)
            if not ssd:  # a retained session the objects alone hold: nothing to promote it into
                _request(eng, "t1", _envelope(_retain("chat", {"start": 0, "priority": 60})), ks)
                eng.store(ks)
                eng.settle()
                eng.evict_primary()
            _request(eng, "t2", _envelope(_prefetch("chat")), ks)
            stats = eng.tier._hints.stats
            assert stats.applications(PREFETCH_ACTION, result) == 1
            assert stats.applications(PREFETCH_ACTION, "queued") == 0
            assert eng.lookup(ks) == ([LookupResult.MISS] * 3 if ssd else [HIT] * 3)  # the request goes on
        finally:
            eng.stop()


def test_covers_output_protects_the_generated_chunks(tmp_path: Path) -> None:
    """A prompt of 69 tokens (4 whole chunks and 5 tokens) and 43 generated: the prompt's
    directive at 80 and covers_output at 50. Chunks wholly in the prompt get 80; chunk 4 holds
    prompt tokens 64-68 and generated 69-79, so it gets the weaker 50, as do those after it."""
    eng = Engine.start(_settings(tmp_path))
    try:
        hints = _envelope(_retain("chat", {"start": 0, "end": 69, "priority": 80, "duration": 3600},
                                  {"covers_output": True, "priority": 50, "duration": 600}))
        prompt, generated = keys(4, tag="p"), keys(3, tag="g")
        ctx = _request(eng, "r", hints, prompt)
        assert eng.lookup(prompt) == [LookupResult.MISS] * 4  # admission: only the prompt's chunks are keyed
        for i, k in enumerate(generated):  # decoding fills chunks 4-6
            ctx.set_offload_key_position(k, (4 + i + 1) * CHUNK)
        eng.store(prompt + generated)
        eng.settle()
        ssd = eng.tier.store.retention.retention_of(0)
        bks = block_keys(eng.tier.namespace, prompt + generated)
        assert [ssd.priority(b) for b in bks] == [80, 80, 80, 80, 50, 50, 50]
        now = time.time()
        assert ssd.get(bks[0]).expiry > now + 3000 and ssd.get(bks[4]).expiry < now + 700  # (50, +600 s)
    finally:
        eng.stop()


def test_kv_fetch_is_counted_and_never_fails_the_request(tmp_path: Path) -> None:
    eng = Engine.start(_settings(tmp_path))
    try:
        ks = keys(3, tag="f")
        eng.store(ks)
        eng.settle()
        eng.evict_primary()
        fetch = ("kv.fetch", {"source_control_endpoint": "tcp://10.0.0.7:23280", "block_hashes": [11, 22, 33]})
        _request(eng, "peer", _envelope(fetch), ks)
        stats = eng.tier._hints.stats
        assert stats.actions(FETCH_ACTION, "accepted") == 1
        assert stats.applications(FETCH_ACTION, "left_to_peer") == 1
        assert eng.lookup(ks) == [HIT] * 3
        assert all(np.array_equal(eng.read(k), payload(k)) for k in ks)
        registry = eng.tier.store.metrics.registry
        assert registry.get_sample_value("dtkv_hint_applied_total",
                                         {"action": "kv.fetch", "result": "left_to_peer"}) == 1
    finally:
        eng.stop()
