"""KV events name their blocks' tenant: our vLLM connector's stored and removed events carry the
request's tenant id (the keyed digest of its ``cache_salt``, never the salt; the default tenant's
id without one) in ``dtkv_tenant``, through the scheduler's ledger and onto the wire as vLLM's
publisher encodes it, where decoders that do not know the field still read the event."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import msgspec
import torch
from test_connector_scheduler import BS, FakeLookup, FakeRequest, sched_output
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.blocks.tenant import DEFAULT_TENANT, tenant_hex, tenant_id
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.events import (
    BlockResidency,
    ResidencyLedger,
    block_stored,
    event_tenant,
    external_hash,
)
from dynamo_tiered_kv.connectors.vllm.metadata import TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole
from dynamo_tiered_kv.policy.residency import DISK, HOST

PROMPT = list(range(4 * BS))  # four full blocks
DEPLOYMENT_SALT = "deployment-salt-7c1e"


def _roles(tmp_path, salt: str = "") -> tuple[SchedulerRole, WorkerRole]:
    """A scheduler with KV events on and one worker (host and SSD tiers) of one deployment."""
    sched = SchedulerRole(TieredKVConfig.from_mapping({"tenant_salt": salt}), model_id="m", block_size=BS,
                          lookup=FakeLookup(set()), kv_events=True)
    cfg = {"ssd_dir": str(tmp_path / "ssd"), "host_capacity_bytes": 64 << 20, "metrics_port": None,
           "ssd_seal_idle_s": 3600, "tenant_salt": salt}
    w = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bfloat16", block_size=BS,
                   num_kv_heads=2, head_size=8, tp_rank=0, tp_size=1, engine_key=f"t-{uuid.uuid4().hex[:8]}",
                   authkey=b"k")
    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=8, block_size=BS,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
    return sched, w


def _step(sched: SchedulerRole, w: WorkerRole, meta: TieredKVMetadata) -> list[Any]:
    """One engine step: the worker runs ``meta``, its events go through the scheduler's ledger."""
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.store is not None and w.store.drain(30)
    sched.update_connector_output(SimpleNamespace(invalid_block_ids=set(), finished_recving=None,
                                                  kv_connector_worker_meta=None, kv_cache_events=w.take_kv_events()))
    return sched.take_events()


def _save(sched: SchedulerRole, w: WorkerRole, req: FakeRequest, block_ids: list[int]) -> list[Any]:
    """The request's blocks saved through the scheduler and the worker; the events announced."""
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 0)
    meta = sched.build_connector_meta(sched_output(new=[(req.request_id, block_ids, 0)],
                                                   tokens={req.request_id: len(req.all_token_ids)}))
    return _step(sched, w, meta)


def _stored_tenants(events: list[Any]) -> dict[str, set[str | None]]:
    """medium -> the ``dtkv_tenant`` values of the stored events (None where a field is missing)."""
    out: dict[str, set[str | None]] = {}
    for e in events:
        if isinstance(e, BlockStored):
            out.setdefault(e.medium, set()).add(getattr(e, "dtkv_tenant", None))
    return out


def test_stored_events_carry_the_requests_tenant_and_the_default_one_without_a_salt(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        acme = _save(sched, w, FakeRequest("acme-1", PROMPT, cache_salt="acme"), [0, 1, 2, 3])
        anon = _save(sched, w, FakeRequest("anon-1", [t + 1 for t in PROMPT]), [4, 5, 6, 7])
        acme_hex = tenant_hex(tenant_id("acme"))
        assert _stored_tenants(acme) == {"CPU": {acme_hex}, "STORAGE": {acme_hex}}  # host and SSD tiers
        assert _stored_tenants(anon) == {"CPU": {"0000000000000000"}, "STORAGE": {"0000000000000000"}}
        assert {event_tenant(e) for e in anon} == {DEFAULT_TENANT}
        assert sum(len(e.block_hashes) for e in acme) == 8  # four blocks, announced in two tiers
        # a cache reset withdraws every block: each tenant's removals name that tenant
        gone = _step(sched, w, TieredKVMetadata(reset_cache=True))
        removed: dict[str | None, int] = {}
        for e in gone:
            assert isinstance(e, BlockRemoved)
            removed[getattr(e, "dtkv_tenant", None)] = removed.get(getattr(e, "dtkv_tenant", None), 0) + len(
                e.block_hashes)
        assert removed == {acme_hex: 8, "0000000000000000": 8}
    finally:
        w.shutdown()


def test_a_deployment_salt_keys_the_id_and_no_salt_reaches_the_wire(tmp_path) -> None:
    sched, w = _roles(tmp_path, salt=DEPLOYMENT_SALT)
    try:
        events = _save(sched, w, FakeRequest("acme-1", PROMPT, cache_salt="acme-secret-salt"), [0, 1, 2, 3])
        events += _save(sched, w, FakeRequest("anon-1", [t + 1 for t in PROMPT]), [4, 5, 6, 7])
        # as vLLM's ZMQ publisher encodes a step's batch
        wire = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
        assert b"acme-secret-salt" not in wire and DEPLOYMENT_SALT.encode() not in wire
        raw = msgspec.msgpack.decode(wire)[1]
        named = {tenant_hex(tenant_id("acme-secret-salt", deployment_salt=DEPLOYMENT_SALT)),
                 tenant_hex(tenant_id(None, deployment_salt=DEPLOYMENT_SALT))}  # the deployment's own tenant
        assert {m["type"] for m in raw} == {"BlockStored"} and {m["dtkv_tenant"] for m in raw} == named
        # vLLM's own classes (and any decoder that ignores unknown keys) still read every event
        plain = msgspec.msgpack.decode(wire, type=KVEventBatch).events
        assert [type(e) for e in plain] == [BlockStored] * len(events)
        assert [e.block_hashes for e in plain] == [e.block_hashes for e in events]
    finally:
        w.shutdown()


def test_runs_and_removals_never_mix_tenants() -> None:
    a, b = tenant_id("a"), tenant_id("b")
    res = BlockResidency(BS)
    hs = [bytes([i + 1]) * 16 for i in range(4)]
    # one chain, but the last two blocks were saved for another tenant: two runs, not one
    res.track([b"k0", b"k1"], hs[:2], None, list(range(2 * BS)), tenant=a)
    res.track([b"k2", b"k3"], hs[2:], hs[1], list(range(2 * BS)), tenant=b)
    res.stored(DISK, [b"k0", b"k1", b"k2", b"k3"])
    res.removed(DISK, [b"k1", b"k2"])
    events = res.take()
    assert [(type(e).__name__, event_tenant(e), len(e.block_hashes)) for e in events] == [
        ("TenantBlockStored", a, 2), ("TenantBlockStored", b, 2),
        ("TenantBlockRemoved", a, 1), ("TenantBlockRemoved", b, 1)]
    assert events[1].parent_block_hash == external_hash(hs[1])
    # the scheduler's ledger keeps the tenant when it splits a run across ranks
    ledger = ResidencyLedger()
    run = block_stored(hs, None, list(range(4 * BS)), BS, medium=HOST, tenant=a)
    assert ledger.apply([block_stored(hs[2:], hs[1], list(range(2 * BS)), BS, medium=HOST, tenant=a)], 2) == []
    (part,) = ledger.apply([run], 2)
    assert part.block_hashes == [external_hash(h) for h in hs[2:]] and event_tenant(part) == a
    assert hash(part) != hash(msgspec.structs.replace(part, dtkv_tenant=tenant_hex(b)))
