"""DynamoTieredKVTier under vLLM 0.33's TieringOffloadingManager: real spec, real shared region,
real factory, our real SSD tier (O_DIRECT where the filesystem allows) and moto/Ceph S3."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from tiering_engine import TIER, Engine, keys, payload
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from dynamo_tiered_kv.connectors.vllm_tiering import DynamoTieredKVTier, RequestHints
from dynamo_tiered_kv.connectors.vllm_tiering.key_mapping import block_keys
from dynamo_tiered_kv.errors import ConfigError

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def ssd(tmp_path: Path, **kw: object) -> dict[str, object]:
    return {"ssd_dir": str(tmp_path / "ssd"), "ssd_segment_bytes": 1 << 20, "ssd_capacity_bytes": 64 << 20,
            "staging_slab_bytes": 256 << 10, "staging_slabs": 4, **kw}


def metric(eng: Engine, name: str, **labels: str) -> float:
    return eng.tier.store.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_factory_builds_the_tier_from_the_secondary_tiers_entry(tmp_path: Path) -> None:
    eng = Engine.start(ssd(tmp_path))
    try:
        assert isinstance(eng.tier, SecondaryTierManager)
        assert SecondaryTierFactory.get_tier_class(TIER) is DynamoTieredKVTier
        assert eng.tier.medium is Medium.STORAGE and eng.tier.locality is Locality.LOCAL
        assert eng.tier.cache_hit_source is CacheHitSource.DISK
        assert [t.name for t in eng.tier.store.tiers] == ["ssd"]  # vLLM's CPU tier is the host tier
    finally:
        eng.stop()


def test_store_evict_lookup_load_returns_the_same_bytes(tmp_path: Path) -> None:
    eng = Engine.start(ssd(tmp_path))
    try:
        ks = keys(6)
        eng.store(ks)
        eng.settle()
        eng.evict_primary()
        with eng.manager.lock:
            assert all(eng.manager.primary_tier.lookup(k, eng.ctx) is MISS for k in ks)
        assert eng.lookup(ks) == [HIT] * 6
        for k in ks:
            assert np.array_equal(eng.read(k), payload(k))
        with eng.manager.lock:
            assert eng.manager.get_load_source(ks[0], eng.ctx) is CacheHitSource.DISK
        assert metric(eng, "dtkv_tier_hits_total", tier="ssd") >= 6
        assert eng.lookup(keys(1, tag="never-stored")) == [MISS]
    finally:
        eng.stop()


def test_a_new_process_over_the_same_directory_finds_the_chunks(tmp_path: Path) -> None:
    ks = keys(5)
    first = Engine.start(ssd(tmp_path))
    first.store(ks)
    first.settle()
    first.stop()
    again = Engine.start(ssd(tmp_path))
    try:
        assert again.lookup(ks) == [HIT] * 5
        assert all(np.array_equal(again.read(k), payload(k)) for k in ks)
    finally:
        again.stop()


def test_another_model_or_tenant_never_sees_the_chunks(tmp_path: Path) -> None:
    ks = keys(2)
    first = Engine.start(ssd(tmp_path, tenant_salt="a"))
    first.store(ks)
    first.stop()
    for other in (dict(tenant_salt="b"), dict(tenant_salt="a", model_id="org/other")):
        eng = Engine.start(ssd(tmp_path, **other))
        try:
            assert eng.lookup(ks) == [MISS, MISS]
        finally:
            eng.stop()


def _flip_a_payload_byte(root: Path, chunk: np.ndarray) -> None:
    needle = chunk[4000:4064].tobytes()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        data = bytearray(f.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + 7] ^= 0x40
            f.write_bytes(bytes(data))
            return
    raise AssertionError("record payload not found in the SSD files")


def test_a_corrupt_record_is_a_miss_and_never_reaches_the_cpu_tier(tmp_path: Path) -> None:
    ks = keys(3)
    first = Engine.start(ssd(tmp_path))
    first.store(ks)
    first.stop()
    _flip_a_payload_byte(tmp_path / "ssd", payload(ks[1]))
    eng = Engine.start(ssd(tmp_path))
    try:
        assert eng.lookup(ks) == [HIT, MISS, HIT]
        with eng.manager.lock:
            assert eng.manager.primary_tier.lookup(ks[1], eng.ctx) is MISS
        assert np.array_equal(eng.read(ks[0]), payload(ks[0]))
        assert metric(eng, "dtkv_checksum_failures_total", tier="ssd") >= 1
        assert eng.lookup(ks[1:2]) == [MISS]  # asked again: still a miss, never a retry loop
    finally:
        eng.stop()


def test_a_failed_chunk_fails_the_rest_of_its_job_but_keeps_the_prefix(tmp_path: Path) -> None:
    """One promotion job of three chunks whose middle record is corrupt: vLLM is told the first
    was restored (successful_keys) and the others failed."""
    ks = keys(3)
    first = Engine.start(ssd(tmp_path))
    first.store(ks)
    first.stop()
    _flip_a_payload_byte(tmp_path / "ssd", payload(ks[1]))
    eng = Engine.start(ssd(tmp_path))
    try:
        with eng.manager.lock:
            pending = [eng.manager.lookup(k, eng.ctx) for k in ks]
        assert pending == [LookupResult.HIT_PENDING] * 3
        results = []
        tier_poll = eng.tier.get_finished_jobs
        eng.tier.get_finished_jobs = lambda: results.extend(r := list(tier_poll())) or r  # type: ignore[method-assign]
        eng.settle()
        (res,) = results
        assert not res.success and list(res.successful_keys or ()) == ks[:1]
        assert eng.lookup(ks) == [HIT, MISS, MISS]
    finally:
        eng.stop()


def test_shutdown_writes_every_acknowledged_chunk(tmp_path: Path) -> None:
    ks = keys(12)
    eng = Engine.start(ssd(tmp_path), chunks=16)
    for i in range(0, 12, 3):
        eng.store(ks[i:i + 3])  # no stepping: jobs may still be queued when the engine stops
    eng.stop()
    again = Engine.start(ssd(tmp_path))
    try:
        assert again.lookup(ks) == [HIT] * 12
    finally:
        again.stop()


def test_many_concurrent_jobs_with_scarce_staging(tmp_path: Path) -> None:
    """16 store jobs in flight over 2 staging slabs of one chunk each, then 4 requests' loads."""
    ks = keys(64)
    eng = Engine.start(ssd(tmp_path, staging_slab_bytes=64 << 10, staging_slabs=2, job_threads=4),
                       chunks=64)
    try:
        for i in range(0, 64, 4):
            eng.store(ks[i:i + 4])
        eng.settle()
        eng.evict_primary()
        assert eng.tier.store.drain(30)  # chunks accepted but not yet on the SSD would be RETRY
        reqs = [eng.new_request() for _ in range(4)]
        with eng.manager.lock:
            for r, ctx in enumerate(reqs):
                assert {eng.manager.lookup(k, ctx) for k in ks[r * 16:(r + 1) * 16]} == {LookupResult.HIT_PENDING}
        eng.settle()
        for r, ctx in enumerate(reqs):
            eng.ctx = ctx
            part = ks[r * 16:(r + 1) * 16]
            assert eng.lookup(part) == [HIT] * 16
            assert all(np.array_equal(eng.read(k), payload(k)) for k in part)
    finally:
        eng.stop()


def test_kv_events_announce_the_ssd_as_local_storage(tmp_path: Path) -> None:
    eng = Engine.start(ssd(tmp_path))
    try:
        ks = keys(3)
        eng.store(ks)
        eng.settle()
        assert eng.tier.store.drain(30)  # the SSD write lands after the store job (a staging copy)
        with eng.manager.lock:
            ours = [e for e in eng.manager.take_events() if e.ownership is not None]
        assert len(ours) == 1
        (ev,) = ours
        assert (ev.medium, ev.locality, ev.removed) == (Medium.STORAGE, Locality.LOCAL, False)
        assert ev.ownership == "DynamoTieredKVTier/ssd" and ev.removal_expected and list(ev.keys) == ks
    finally:
        eng.stop()


def test_no_events_when_vllm_publishes_none(tmp_path: Path) -> None:
    eng = Engine.start(ssd(tmp_path), events=False)
    try:
        eng.store(keys(2))
        eng.settle()
        assert list(eng.tier.take_events()) == []
    finally:
        eng.stop()


def test_kv_hints_are_kept_on_the_request_context(tmp_path: Path) -> None:
    eng = Engine.start(ssd(tmp_path))
    try:
        hints = KvHintsEnvelope(protocol_version="1.0", message_id="m1", actions=[KvHintAction(
            action_id="a1", action_type="kv.retain", action_version="1.0", payload={"duration_s": 3600})])
        ctx = eng.new_request(ReqContext(req_id="hinted", kv_hints=hints))
        state = ctx.get_state(RequestHints)
        assert state is not None and state.envelope is hints
        assert eng.new_request().get_state(RequestHints) is None
    finally:
        eng.stop()


@pytest.mark.parametrize("settings, problem", [
    ({"ssd_dirr": "/tmp/x"}, "ssd_dirr: unknown setting"),
    ({}, "needs ssd_dir, object_url or both"),
    ({"ssd_dir": "/tmp/x", "job_threads": 0}, "job_threads"),
    ({"ssd_dir": "/tmp/x", "locality": "NEARBY"}, "locality: must be LOCAL or REMOTE"),
])
def test_bad_settings_fail_at_start_naming_the_field(settings: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        Engine.start(settings)


def test_locality_setting_overrides_the_derived_one(tmp_path: Path) -> None:
    eng = Engine.start(ssd(tmp_path, locality="remote"))  # an ssd_dir on shared storage
    try:
        assert eng.tier.locality is Locality.REMOTE
        eng.store(keys(1))
        eng.settle()
        assert eng.tier.store.drain(30)
        (ev,) = eng.tier.take_events()
        assert (ev.medium, ev.locality) == (Medium.STORAGE, Locality.REMOTE)
    finally:
        eng.stop()


def test_host_tier_default_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_HOST_CAPACITY_BYTES", str(4 << 20))
    eng = Engine.start(ssd(tmp_path))
    try:
        assert [t.name for t in eng.tier.store.tiers] == ["host", "ssd"]
    finally:
        eng.stop()


def test_shutdown_lets_vllm_unmap_its_region(tmp_path: Path) -> None:
    """Our views of vLLM's shared region are gone after the tier's shutdown, so vLLM's primary
    tier releases its memoryview and unmaps and unlinks the region."""
    eng = Engine.start(ssd(tmp_path))
    region = eng.manager.primary_tier._mmap_region
    eng.store(keys(2))
    eng.settle()
    eng.stop()
    assert region.mmap_obj is None and not os.path.exists(region.mmap_path)


def test_a_chunk_on_its_way_to_the_ssd_is_retry_then_hit(tmp_path: Path) -> None:
    """The store job ends once the chunks are staged; until the SSD write lands, lookup says
    RETRY (not MISS: the engine would recompute what is about to be readable)."""
    import asyncio
    import threading

    eng = Engine.start(ssd(tmp_path))
    ssd_tier = eng.tier.store.tiers[0]
    gate = threading.Event()
    write_many = ssd_tier.write_many

    async def held(items):  # type: ignore[no-untyped-def]
        await asyncio.to_thread(gate.wait, 30)
        return await write_many(items)

    ssd_tier.write_many = held  # type: ignore[method-assign]
    try:
        ks = keys(2)
        eng.store(ks)
        eng.settle()
        eng.evict_primary()
        assert [eng.tier.lookup(k, eng.ctx) for k in ks] == [LookupResult.RETRY] * 2
        gate.set()
        assert eng.tier.store.drain(30)
        assert [eng.tier.lookup(k, eng.ctx) for k in ks] == [HIT, HIT]
    finally:
        gate.set()
        eng.stop()


def test_a_failing_ssd_degrades_to_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SSD write fails: store jobs still finish, lookups end as MISS once nothing is queued
    (never an endless RETRY), and the keys staged meanwhile stay bounded."""
    from dynamo_tiered_kv.connectors.vllm_tiering import tier as tier_module

    monkeypatch.setattr(tier_module, "MAX_PENDING_KEYS", 4)
    eng = Engine.start(ssd(tmp_path), chunks=16)

    async def broken(items):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error")

    eng.tier.store.tiers[0].write_many = broken  # type: ignore[method-assign]
    try:
        ks = keys(9)
        for i in range(0, 9, 3):
            eng.store(ks[i:i + 3])
        eng.settle()
        assert eng.tier.store.drain(30)
        assert len(eng.tier._pending) <= 4
        eng.evict_primary()
        assert eng.lookup(ks) == [MISS] * 9
        assert metric(eng, "dtkv_tier_errors_total", tier="ssd", op="write") >= 1
    finally:
        eng.stop()


def test_a_store_job_waits_per_slab_not_for_the_whole_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging frees slowly but steadily: every slab (five chunks each) of a four-slab job waits a while, none longer
    than store_wait_s, so the whole job is stored (a job-wide bound dropped its later chunks, which
    vLLM then recomputed)."""
    ks = keys(20)
    eng = Engine.start(ssd(tmp_path, staging_slab_bytes=64 << 10, staging_slabs=2, store_wait_s=0.5), chunks=24)
    real, last = eng.tier._has_room, [time.monotonic()]

    def slow_room() -> bool:  # room appears 0.3 s after the previous slab was taken
        if time.monotonic() - last[0] < 0.3:
            return False
        last[0] = time.monotonic()
        return real()

    try:
        for c, k in enumerate(ks):
            eng.rows[c] = payload(k)
        bks = block_keys(eng.tier.namespace, ks)
        monkeypatch.setattr(eng.tier, "_has_room", slow_room)
        result = eng.tier._store(1, list(range(20)), bks)  # the job body, as one of our threads runs it
        monkeypatch.setattr(eng.tier, "_has_room", real)
        assert result.success
        assert eng.tier.store.drain(30)
        assert all(eng.tier.store.lookup([bk]).num_blocks == 1 for bk in bks)
    finally:
        eng.stop()
