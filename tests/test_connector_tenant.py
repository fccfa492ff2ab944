"""Our vLLM connector names each request's tenant: the scheduler's save specs carry the keyed
digest of the request's ``cache_salt`` (the default tenant without one), the worker writes it into
every record, the host tier accounts the blocks to it, and the request's ``kv.retain`` claims count
toward that tenant's retained share."""

from __future__ import annotations

from types import SimpleNamespace

from test_connector_hint_isolation import _envelope, _retain
from test_connector_hints import HintedRequest, _roles
from test_connector_scheduler import BS, sched_output

from dynamo_tiered_kv.blocks.codec import record_tenant
from dynamo_tiered_kv.blocks.tenant import DEFAULT_TENANT, tenant_hex, tenant_id

PROMPT = list(range(4 * BS))  # four full blocks


def _save(sched, w, req, block_ids: list[int]) -> list[bytes]:
    """The request through the scheduler's save path and the worker's save; returns its keys."""
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 0)
    meta = sched.build_connector_meta(sched_output(new=[(req.request_id, block_ids, 0)],
                                                   tokens={req.request_id: len(PROMPT)}))
    (save,) = meta.saves
    assert save.tenant == tenant_id(getattr(req, "cache_salt", None))
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.store.drain(30)
    return w.keys_of(sched._reqs[req.request_id].hashes_upto(4))


def test_saved_records_carry_the_requests_tenant(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:
        keys = _save(sched, w, HintedRequest("acme-1", PROMPT, cache_salt="acme"), [0, 1, 2, 3])
        _save(sched, w, HintedRequest("anon-1", [t + 1 for t in PROMPT]), [4, 5, 6, 7])
        host = w.store.tiers[0]
        held = host.tenant_usage()
        acme = tenant_id("acme")  # the test config has no tenant_salt
        assert held is not None and set(held) == {acme, DEFAULT_TENANT}
        assert held[acme][1] == 4 and held[DEFAULT_TENANT][1] == 4
        buf = bytearray(host.size_of(keys[0]))
        host.read_sync(keys[0], memoryview(buf))
        assert record_tenant(buf) == acme
    finally:
        w.shutdown()


def test_retain_claims_count_toward_the_requests_tenant(tmp_path) -> None:
    sched, w = _roles(tmp_path)
    try:  # a first save tells the store its record size; claims made before one count no bytes
        _save(sched, w, HintedRequest("first", [t + 7 for t in PROMPT]), [4, 5, 6, 7])
        req = HintedRequest("keep", PROMPT, cache_salt="acme",
                            kv_transfer_params={"kv_hints": _envelope(_retain("s", {"priority": 90, "duration": 60}))})
        _save(sched, w, req, [0, 1, 2, 3])
        per = w.store.retention.retention_of(0).tenant_protected_bytes()
        assert set(per) == {tenant_hex(tenant_id("acme"))} and per[tenant_hex(tenant_id("acme"))] > 0
    finally:
        w.shutdown()
