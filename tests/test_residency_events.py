"""Tier-aware KV events: which tier holds a block, in mediums Dynamo's KV router maps.

The store reports residency (``residency``), the worker turns store keys into vLLM events
(``events.BlockResidency``), the scheduler announces a block once every TP/PP rank holds it and
drops it once any rank lost it (``events.ResidencyLedger``).
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.events import (
    EVENT_MEDIUM,
    ROUTER_TIER,
    STORAGE_VOCABULARY,
    BlockResidency,
    ResidencyLedger,
    TieredKVEvents,
    block_removed,
    block_stored,
    external_hash,
    residency_of,
)
from dynamo_tiered_kv.connectors.vllm.metadata import SaveSpec, TieredKVMetadata
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.connectors.vllm.worker import WorkerRole
from dynamo_tiered_kv.policy.residency import DISK, EXTERNAL, HOST, medium_of
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.objectstore import ObjectTier
from dynamo_tiered_kv.tiers.ssd import SSDTier

BS = 4

# Dynamo's KV router, StorageTier::from_kv_medium (shared/research/PEERS-2026-11.md section 4.2):
# every other string is dropped by the router.
ROUTER_MEDIUMS = {
    "GPU": "Device", "DEVICE": "Device",
    "CPU": "HostPinned", "CPU_PINNED": "HostPinned", "CPU_TIER1": "HostPinned",
    "CPU_TIER2": "Disk", "DISK": "Disk", "NVME": "Disk", "STORAGE": "Disk",
    "EXTERNAL": "External", "NETWORK": "External", "REMOTE": "External", "SHARED": "External",
}


def test_every_medium_we_emit_is_one_the_router_maps_to_the_right_tier() -> None:
    assert medium_of(HostTier) == HOST and ROUTER_MEDIUMS[HOST] == "HostPinned"
    assert medium_of(SSDTier) == DISK and ROUTER_MEDIUMS[DISK] == "Disk"
    assert medium_of(ObjectTier) == EXTERNAL and ROUTER_MEDIUMS[EXTERNAL] == "External"
    assert all(ROUTER_MEDIUMS[EVENT_MEDIUM[m].medium] == tier for m, tier in ROUTER_TIER.items())
    assert "dtkv" not in ROUTER_MEDIUMS  # what we used to send: dropped by the router


def test_events_speak_vllm_storage_vocabulary_with_locality_and_one_owner_per_tier() -> None:
    assert STORAGE_VOCABULARY  # the installed vLLM (0.32) has MEDIUM_STORAGE, locality and ownership
    ssd = block_stored([b"a" * 16], None, list(range(BS)), BS, medium=DISK)
    assert (ssd.medium, ssd.locality, ssd.ownership) == ("STORAGE", "LOCAL", "dtkv/ssd")
    obj = block_removed([1], EXTERNAL)
    assert (obj.medium, obj.locality, obj.ownership) == ("STORAGE", "REMOTE", "dtkv/object")
    host = block_stored([b"a" * 16], None, list(range(BS)), BS, medium=HOST)
    assert (host.medium, host.locality) == ("CPU", "LOCAL")
    assert [residency_of(e) for e in (ssd, obj, host)] == [DISK, EXTERNAL, HOST]
    # the ledger keeps the SSD and the object copy (both STORAGE) apart
    ledger = ResidencyLedger()
    on_disk = block_stored([b"b" * 16], None, list(range(BS)), BS, medium=DISK)
    in_objects = block_stored([b"b" * 16], None, list(range(BS)), BS, medium=EXTERNAL)
    assert ledger.apply([on_disk, in_objects], 2) == []  # one rank each
    assert ledger.apply([on_disk], 2) == [on_disk]  # both ranks on disk; the objects still one rank
    (gone,) = ledger.apply([block_removed([external_hash(b"b" * 16)], DISK)], 2)
    assert (gone.medium, gone.locality) == ("STORAGE", "LOCAL")


def _worker(tmp_path, **cfg) -> WorkerRole:
    cfg = {"ssd_dir": str(tmp_path / "ssd"), "metrics_port": None, "ssd_seal_idle_s": 3600,
           "staging_slab_bytes": 1 << 20, "staging_slabs": 4, **cfg}
    w = WorkerRole(TieredKVConfig.from_mapping(cfg), model_id="m", kv_dtype="bfloat16", block_size=BS,
                   num_kv_heads=2, head_size=8, tp_rank=0, tp_size=1, engine_key=f"t-{uuid.uuid4().hex[:8]}",
                   authkey=b"k")
    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=16, block_size=BS,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
    return w


def _save(w: WorkerRole, hashes: list[bytes], ids: list[int]) -> None:
    spec = SaveSpec("r", ids, hashes, 0, token_ids=list(range(len(ids) * BS)))
    w.wait_for_save(TieredKVMetadata(saves=[spec]))
    assert w.store.drain(10)


def _ops(w: WorkerRole) -> list[tuple[str, str, int]]:
    out = w.take_kv_events()
    if out is None:
        return []
    ops = []
    for e in out.get_all_events():
        kind = "stored" if isinstance(e, BlockStored) else "removed"
        if isinstance(e, BlockStored):
            assert len(e.token_ids) == BS * len(e.block_hashes)
        ops.extend((kind, residency_of(e), h) for h in e.block_hashes)
    return ops


def _hashes(n: int, start: int = 0) -> list[bytes]:
    return [bytes([i + 1]) * 16 for i in range(start, start + n)]


def test_host_eviction_removes_the_host_copy_while_the_ssd_copy_stays_on_disk(tmp_path) -> None:
    w = _worker(tmp_path, host_capacity_bytes=3 * (256 << 10))  # three 256 KiB host chunks: 3 blocks
    try:
        hs = _hashes(5)
        _save(w, hs[:3], [1, 2, 3])
        # the next two push the two oldest out of host memory
        w.wait_for_save(TieredKVMetadata(saves=[SaveSpec("r", [4, 5], hs[2:], 3, token_ids=list(range(2 * BS)))]))
        assert w.store.drain(10)
        ops = _ops(w)
        ext = [external_hash(h) for h in hs]
        assert {h for k, m, h in ops if (k, m) == ("stored", DISK)} == set(ext)
        assert {h for k, m, h in ops if (k, m) == ("stored", HOST)} == set(ext)
        evicted = {h for k, m, h in ops if (k, m) == ("removed", HOST)}
        assert evicted == set(ext[:2])  # least recently used first
        assert not any(k == "removed" and m == DISK for k, m, _ in ops)
        # a block restored from the SSD is promoted into host memory again: stored CPU_PINNED anew
        w.store.load(w.layout, [9], [w.keys_of(hs[:1])[0]])
        assert w.store.drain(10)
        ops = _ops(w)
        assert ("stored", HOST, ext[0]) in ops and not any(m == DISK for _, m, _ in ops)
        # saving blocks the tiers hold already announces nothing twice
        _save(w, hs[:1], [6])
        assert [o for o in _ops(w) if o[0] == "stored"] == []
    finally:
        w.shutdown()


def test_flush_to_the_object_tier_is_stored_external_and_reset_removes_every_tier(tmp_path) -> None:
    w = _worker(tmp_path, host_capacity_bytes=16 << 20, object_url=f"file://{tmp_path / 'objects'}")
    try:
        hs = _hashes(3)
        ext = {external_hash(h) for h in hs}
        _save(w, hs, [1, 2, 3])
        assert {(k, m) for k, m, _ in _ops(w)} == {("stored", HOST), ("stored", DISK)}
        w.store.persist(20)  # seal the segment and let the flusher copy it to the object tier
        ops = _ops(w)
        assert {h for k, m, h in ops if (k, m) == ("stored", EXTERNAL)} == ext
        ev = [e for e in w.store.tiers if medium_of(e) == EXTERNAL]
        assert ev and all(ev[0].contains(k) for k in w.keys_of(hs))
        w.start_load_kv(TieredKVMetadata(reset_cache=True))
        assert w.store.drain(10)
        ops = _ops(w)
        for m in (HOST, DISK, EXTERNAL):
            assert {h for k, mm, h in ops if (k, mm) == ("removed", m)} == ext, m
        assert not any(k == "stored" for k, _, _ in ops)
        assert _ops(w) == []  # drop_local's removals name keys no longer tracked: dropped
    finally:
        w.shutdown()


def test_ssd_eviction_and_ttl_are_removals_from_disk(tmp_path) -> None:
    w = _worker(tmp_path, host_capacity_bytes=0, ssd_ttl_s=100.0)
    try:
        hs = _hashes(2)
        _save(w, hs, [1, 2])
        assert {(k, m) for k, m, _ in _ops(w)} == {("stored", DISK)}
        import time

        assert w.store.retention.sweep_now(time.monotonic() + 1000) == 2
        assert sorted(h for k, m, h in _ops(w) if (k, m) == ("removed", DISK)) == sorted(
            external_hash(h) for h in hs)
    finally:
        w.shutdown()


def test_ssd_segment_eviction_tells_the_hook_the_keys_it_dropped(tmp_path) -> None:
    import asyncio

    from dynamo_tiered_kv.testing import make_record, random_key, small_shape

    shape = small_shape(num_layers=2)  # 12 KiB records

    async def run() -> tuple[list[bytes], list[bytes]]:
        t = SSDTier(tmp_path, capacity_bytes=640 << 10, segment_bytes=128 << 10, idle_seal_s=None)
        await t.open()
        heard: list[bytes] = []
        t.set_residency_hook(SimpleNamespace(evicted=heard.extend))  # type: ignore[arg-type]
        written = []
        try:
            for i in range(60):
                k = random_key(i, b"residency")
                written.append(k)
                await t.write(k, memoryview(make_record(k, i, shape=shape)))
            return heard, [k for k in written if not t.contains(k)]
        finally:
            await t.close()

    heard, missing = asyncio.run(run())
    assert missing and sorted(heard) == sorted(missing)


def test_tracking_is_bounded_and_a_removal_of_an_unknown_key_is_dropped() -> None:
    r = BlockResidency(BS, max_blocks=2)
    keys = [b"k%015d" % i for i in range(3)]
    r.track(keys[:2], _hashes(2), None, list(range(2 * BS)))
    r.stored(DISK, keys[:2])
    (ev,) = r.take()
    assert ev.block_hashes == [external_hash(h) for h in _hashes(2)] and ev.parent_block_hash is None
    r.track(keys[2:], _hashes(1, 2), _hashes(2)[1], list(range(BS)))  # pushes keys[0] out
    (gone,) = r.take()
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == [external_hash(_hashes(1)[0])]
    r.removed(DISK, keys[:1])  # no longer tracked: nothing to say
    r.stored(DISK, keys[:1])
    assert r.take() == []
    r.stored(DISK, keys[1:])
    (ev,) = r.take()  # keys[1] was announced already; keys[2] chains to it
    assert ev.block_hashes == [external_hash(_hashes(1, 2)[0])] and ev.parent_block_hash == external_hash(
        _hashes(2)[1])


def _out(events, world: int, workers: int = 1):
    """A step's connector output as vLLM's KVOutputAggregator builds it from ``workers`` outputs."""
    first = TieredKVEvents(world=world)
    first.add_events(events[0])
    for evs in events[1:workers]:
        first.add_events(evs)
        first.increment_workers(1)
    return SimpleNamespace(invalid_block_ids=set(), finished_recving=None, kv_cache_events=first)


def test_scheduler_announces_a_tier_when_every_rank_holds_it_and_drops_it_when_one_lost_it() -> None:
    from test_connector_scheduler import FakeLookup

    s = SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=BS, lookup=FakeLookup(set()),
                      kv_events=True)
    hs = _hashes(2)
    stored = block_stored(hs, None, list(range(2 * BS)), BS, medium=DISK)
    s.update_connector_output(_out([[stored]], world=2))  # rank 0's write finished first
    assert s.take_events() == []
    s.update_connector_output(_out([[stored]], world=2))  # rank 1 one step later
    assert s.take_events() == [stored]
    # rank 0 evicts the first block from host memory... (host copies announced in one step)
    host = block_stored(hs, None, list(range(2 * BS)), BS, medium=HOST)
    s.update_connector_output(_out([[host], [host]], world=2, workers=2))
    assert s.take_events() == [host]
    s.update_connector_output(_out([[block_removed([external_hash(hs[0])], HOST)]], world=2))
    (rm,) = s.take_events()
    assert (residency_of(rm), rm.block_hashes) == (HOST, [external_hash(hs[0])])
    # ...rank 1 later too: already announced; the disk copy is untouched
    s.update_connector_output(_out([[block_removed([external_hash(hs[0])], HOST)]], world=2))
    assert s.take_events() == []
    # a block only one rank re-stored is not restorable: only the one both hold is announced
    ledger = ResidencyLedger()
    a = ledger.apply([stored], 2)
    assert a == []
    partial = block_stored(hs[1:], hs[0], list(range(BS)), BS, medium=DISK)
    (b,) = ledger.apply([partial], 2)
    assert b.block_hashes == [external_hash(hs[1])] and b.parent_block_hash == external_hash(hs[0])
    assert len(ledger) == 1


def test_no_events_unless_kv_events_are_enabled(tmp_path) -> None:
    from test_connector_scheduler import FakeLookup

    w = _worker(tmp_path, host_capacity_bytes=16 << 20)
    try:
        w.wait_for_save(TieredKVMetadata(saves=[SaveSpec("r", [1, 2], _hashes(2), 0)]))  # no token_ids
        assert w.store.drain(10)
        assert w.take_kv_events() is None
    finally:
        w.shutdown()
    s = SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=BS, lookup=FakeLookup(set()))
    s.update_connector_output(_out([[block_stored(_hashes(1), None, list(range(BS)), BS, medium=DISK)]], world=1))
    assert s.take_events() == []


@pytest.mark.parametrize("world", [1, 3])
def test_ledger_passes_other_events_through(world: int) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared

    assert ResidencyLedger().apply([AllBlocksCleared()], world) == [AllBlocksCleared()]
