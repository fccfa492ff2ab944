"""``dtkv tenants``: list what each tenant holds in a bucket and on an SSD directory, print a
tenant's id, and erase a tenant: its records leave the bucket (objects that mixed tenants are
rewritten without them, so none of its bytes stay), the other tenant's records still restore on a
fresh node, a marker tells nodes to drop it, and a rerun finds nothing left."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from test_encryption_at_rest import _files, _payload_runs
from test_factory import NS, _config, _layout

from dynamo_tiered_kv.blocks.keys import chain_keys, parents_of
from dynamo_tiered_kv.blocks.tenant import tenant_hex, tenant_id
from dynamo_tiered_kv.cli import main
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.tiers.objectstore.localdir import LocalDirBackend
from dynamo_tiered_kv.tiers.objectstore.tenants import mark_erased, read_erasures

pytestmark = pytest.mark.usefixtures("no_dtkv_env")

A, B = tenant_id("alice"), tenant_id("bob")
KEYS_A = chain_keys(NS, np.arange(16 * 4))
KEYS_B = chain_keys(NS, np.arange(1000, 1000 + 16 * 4))


def _fill(tmp_path: Path, **kw) -> None:
    """Four blocks of each tenant, written into the bucket in one batch (one object mixing both
    tenants) and, with ``ssd_dir``, into an SSD directory."""
    src = _layout(1)
    store = build_store(_config(tmp_path, host_capacity_bytes=0, **kw), NS)
    try:
        keys, parents = KEYS_A + KEYS_B, parents_of(KEYS_A) + parents_of(KEYS_B)
        assert store.submit_offload(src, [0, 1, 2, 3], keys[:4], parents[:4], tenant=A)
        assert store.submit_offload(src, [4, 5, 6, 7], keys[4:], parents[4:], tenant=B)
        assert store.drain(30)
    finally:
        store.close()


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["tenants", *argv])
    return rc, capsys.readouterr().out


def test_list_erase_and_restore_the_others(tmp_path: Path, capsys) -> None:
    _fill(tmp_path, ssd_dir=None)  # the object tier written directly
    url = f"file://{tmp_path / 'objects'}"
    rc, out = _cli(capsys, "list", url, "--json")
    rows = json.loads(out)
    assert rc == 0
    assert rows[tenant_hex(A)]["object"]["blocks"] == 4 and rows[tenant_hex(B)]["object"]["blocks"] == 4

    rc, out = _cli(capsys, "erase", f"id:{tenant_hex(A)}", url, "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["records"] == 4 and rep["errors"] == 0
    assert A in asyncio.run(read_erasures(LocalDirBackend(tmp_path / "objects")))

    rc, out = _cli(capsys, "list", url, "--json")
    assert tenant_hex(A) not in json.loads(out) and json.loads(out)[tenant_hex(B)]["object"]["blocks"] == 4
    src = _layout(1)
    a_runs = _payload_runs(src, range(0, 4))
    assert not any(r in blob for blob in _files(tmp_path / "objects") for r in a_runs), \
        "an erased tenant's bytes are still in the bucket"
    b_runs = _payload_runs(src, range(4, 8))
    assert any(r in blob for blob in _files(tmp_path / "objects") for r in b_runs)  # the check can fail

    store = build_store(_config(tmp_path, host_capacity_bytes=0, ssd_dir=None), NS)  # a fresh node
    try:
        objects = store.tiers[-1]
        deadline = time.monotonic() + 60
        while not objects.index_ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.lookup(KEYS_A).num_blocks == 0
        assert store.lookup(KEYS_B).num_blocks == 4
        dst = _layout(2)
        res = store.load(dst, [10, 11, 12, 13], KEYS_B, timeout=30)
        assert res.loaded_block_ids == [10, 11, 12, 13]
        for j in range(2):
            assert np.array_equal(dst.layer_views[j][10:14], src.layer_views[j][4:8])
    finally:
        store.close()

    rc, out = _cli(capsys, "erase", f"id:{tenant_hex(A)}", url, "--json")
    assert rc == 0 and json.loads(out)["records"] == 0  # idempotent
    assert main(["fsck", url]) == 0  # nothing of the erased tenant is left
    capsys.readouterr()


def test_fsck_reports_an_erased_tenants_records_still_listed(tmp_path: Path, capsys) -> None:
    _fill(tmp_path, ssd_dir=None)
    url = f"file://{tmp_path / 'objects'}"
    asyncio.run(mark_erased(LocalDirBackend(tmp_path / "objects"), A, time.time()))  # a marker, nothing deleted
    assert main(["fsck", url]) == 1
    assert f"tenant {tenant_hex(A)} was erased but 4 of its records are still listed" in capsys.readouterr().out


def test_nodes_drop_an_erased_tenant_from_host_and_ssd_at_their_next_refresh(tmp_path: Path, capsys) -> None:
    """A running node (host + SSD + bucket) holds both tenants; after ``dtkv tenants erase`` its
    store drops the erased tenant's blocks from every tier within one refresh and one erasure
    pass, and keeps the other tenant's."""
    src = _layout(1)
    cfg = _config(tmp_path, object_refresh_s=0.2)
    store = build_store(cfg, NS)
    try:
        keys, parents = KEYS_A + KEYS_B, parents_of(KEYS_A) + parents_of(KEYS_B)
        assert store.submit_offload(src, [0, 1, 2, 3], keys[:4], parents[:4], tenant=A)
        assert store.submit_offload(src, [4, 5, 6, 7], keys[4:], parents[4:], tenant=B)
        assert store.drain(30)
        assert store.lookup(KEYS_A).num_blocks == 4
        rc, _ = _cli(capsys, "erase", f"id:{tenant_hex(A)}", f"file://{tmp_path / 'objects'}")
        assert rc == 0
        deadline = time.monotonic() + 30
        while any(t.contains(KEYS_A[0]) for t in store.tiers) and time.monotonic() < deadline:
            time.sleep(0.1)
        for t in store.tiers:
            assert not any(t.contains(k) for k in KEYS_A), f"tier {t.name} still holds the erased tenant"
        assert store.tiers[0].contains(KEYS_B[0]) and store.tiers[1].contains(KEYS_B[0])
    finally:
        store.close()


def test_list_counts_an_ssd_directorys_records_by_tenant(tmp_path: Path, capsys) -> None:
    _fill(tmp_path, object_url=None)
    rc, out = _cli(capsys, "list", "--ssd", str(tmp_path / "ssd"), "--json")
    rows = json.loads(out)
    assert rc == 0 and rows[tenant_hex(A)]["ssd"]["blocks"] == 4 and rows[tenant_hex(B)]["ssd"]["blocks"] == 4


def test_id_prints_the_keyed_digest(capsys, monkeypatch) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_TENANT_SALT", "s3cret")
    rc, out = _cli(capsys, "id", "acme")
    assert rc == 0 and out.strip() == tenant_hex(tenant_id("acme", deployment_salt="s3cret"))


def test_bad_arguments_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["tenants", "erase", "id:xyz", f"file://{tmp_path}"]) == 2
    assert main(["tenants", "list", f"file://{tmp_path / 'missing'}"]) == 2
    assert main(["tenants", "list"]) == 2
