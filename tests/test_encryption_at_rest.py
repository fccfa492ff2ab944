"""Encryption at rest through ``build_store`` (``encryption: on``): records on the SSD and in the
bucket are sealed for their tenant (no plaintext run of the KV bytes in any file), restores give
the engine its exact bytes, a wrong or missing key is a miss that deletes nothing, a reader with
encryption off misses sealed records without condemning them, and an erased tenant's records stop
opening on a fresh node."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from test_factory import NS, _config, _layout

from dynamo_tiered_kv.blocks.keys import chain_keys, parents_of
from dynamo_tiered_kv.blocks.tenant import tenant_id
from dynamo_tiered_kv.errors import ConfigError
from dynamo_tiered_kv.factory import build_store, key_source
from dynamo_tiered_kv.tenants.keystore import TenantKeyStore
from dynamo_tiered_kv.tenants.sealed_tier import SealedTier
from dynamo_tiered_kv.tiers.objectstore.localdir import LocalDirBackend

pytestmark = pytest.mark.usefixtures("no_dtkv_env")

ACME = tenant_id("acme")
KEYS = chain_keys(NS, np.arange(16 * 6))


def _kek(monkeypatch: pytest.MonkeyPatch, seed: int = 1) -> None:
    key = np.random.default_rng(seed).integers(0, 256, 32, dtype=np.uint8).tobytes()
    monkeypatch.setenv("DTKV_TENANT_KEKS", f"v{seed}={base64.b64encode(key).decode()}")


def _sealed_config(tmp_path: Path, **kw):
    return _config(tmp_path, encryption="on", host_capacity_bytes=0, **kw)


def _offload_and_flush(tmp_path: Path) -> None:
    src = _layout(1)
    store = build_store(_sealed_config(tmp_path), NS)
    try:
        assert [type(t) for t in store.tiers] == [SealedTier, SealedTier]
        assert store.submit_offload(src, list(range(6)), KEYS, parents_of(KEYS), tenant=ACME)
        assert store.drain(30)
        assert store.tiers[0].seal_failures == 0
        store._call(store.tiers[0].seal(), timeout=30)
        assert store._call(store.flusher.drain(30), timeout=40)
        assert store.flusher.stats.flushed_segments >= 1
    finally:
        store.close()


def _restore(tmp_path: Path, **kw) -> tuple[list[int], object]:
    store = build_store(_sealed_config(tmp_path, **kw) if kw.get("encryption", "on") == "on" else
                        _config(tmp_path, host_capacity_bytes=0, **kw), NS)
    try:
        objects = store.tiers[-1]
        deadline = time.monotonic() + 60
        while not objects.index_ready and time.monotonic() < deadline:
            time.sleep(0.05)
        dst = _layout(2)
        res = store.load(dst, list(range(10, 16)), KEYS, timeout=30)
        return list(res.loaded_block_ids), dst
    finally:
        store.close()


def _payload_runs(layout, blocks: range) -> list[bytes]:
    """64-byte runs of the engine's KV bytes of ``blocks`` (each layer's K plane of each block)."""
    out = []
    for j in range(2):
        for b in blocks:
            a = np.ascontiguousarray(np.asarray(layout.layer_views[j][b])).view(np.uint8).reshape(-1)
            out += [a[i : i + 64].tobytes() for i in range(0, a.size, a.size // 4)]
    return out


def _files(root: Path) -> list[bytes]:
    return [p.read_bytes() for p in root.rglob("*") if p.is_file()]


def test_records_at_rest_hold_no_plaintext_and_restore_exactly(tmp_path: Path, monkeypatch) -> None:
    _kek(monkeypatch)
    _offload_and_flush(tmp_path)
    runs = _payload_runs(_layout(1), range(6))
    for blob in _files(tmp_path / "ssd") + _files(tmp_path / "objects"):
        assert not any(r in blob for r in runs), "a plaintext run of the KV bytes is on disk"
    src = _layout(1)
    for source in ("ssd", "object"):  # the node's SSD serves; then a fresh node: the bucket serves
        if source == "object":
            shutil.rmtree(tmp_path / "ssd")
        loaded, dst = _restore(tmp_path)
        assert loaded == list(range(10, 16)), source
        for j in range(2):
            assert np.array_equal(dst.layer_views[j][10:16], src.layer_views[j][0:6]), source


def test_without_encryption_the_same_bytes_are_on_disk_in_clear(tmp_path: Path) -> None:
    src = _layout(1)
    store = build_store(_config(tmp_path, host_capacity_bytes=0), NS)
    try:
        assert store.submit_offload(src, list(range(6)), KEYS, parents_of(KEYS), tenant=ACME)
        assert store.drain(30)
    finally:
        store.close()
    runs = _payload_runs(src, range(6))
    assert any(r in blob for blob in _files(tmp_path / "ssd") for r in runs)  # the check above can fail


def test_a_wrong_key_is_a_miss_and_deletes_nothing(tmp_path: Path, monkeypatch) -> None:
    _kek(monkeypatch, 1)
    _offload_and_flush(tmp_path)
    shutil.rmtree(tmp_path / "ssd")
    _kek(monkeypatch, 2)  # another KEK: the tenant key does not unwrap
    loaded, _ = _restore(tmp_path)
    assert loaded == []
    _kek(monkeypatch, 1)  # the right key again: nothing was deleted or quarantined meanwhile
    loaded, _ = _restore(tmp_path)
    assert loaded == list(range(10, 16))


def test_a_reader_with_encryption_off_misses_sealed_records_and_keeps_them(tmp_path: Path, monkeypatch) -> None:
    _kek(monkeypatch)
    _offload_and_flush(tmp_path)
    shutil.rmtree(tmp_path / "ssd")
    loaded, _ = _restore(tmp_path, encryption="off")
    assert loaded == []
    loaded, _ = _restore(tmp_path)
    assert loaded == list(range(10, 16))


def test_an_erased_tenant_stops_opening_on_a_fresh_node(tmp_path: Path, monkeypatch) -> None:
    _kek(monkeypatch)
    _offload_and_flush(tmp_path)
    shutil.rmtree(tmp_path / "ssd")
    keys = TenantKeyStore(LocalDirBackend(tmp_path / "objects"), key_source(_sealed_config(tmp_path)))
    assert asyncio.run(keys.erase(ACME))
    loaded, _ = _restore(tmp_path)
    assert loaded == []


def test_encryption_needs_a_key_source(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("DTKV_TENANT_KEKS", raising=False)
    with pytest.raises(ConfigError, match=r"DTKV_TENANT_KEKS"):
        build_store(_sealed_config(tmp_path), NS).close()
    assert not os.path.exists(tmp_path / "ssd" / "tenant-keys")


def _kek_text(*seeds: int, current: int) -> str:
    keys = [f"v{s}={base64.b64encode(np.random.default_rng(s).integers(0, 256, 32, dtype=np.uint8).tobytes()).decode()}"
            for s in seeds]
    return ";".join([*keys, f"current=v{current}"])


def test_rotate_keys_rewraps_and_the_old_kek_can_go(tmp_path: Path, monkeypatch, capsys) -> None:
    from dynamo_tiered_kv.cli import main

    _kek(monkeypatch, 1)
    _offload_and_flush(tmp_path)
    shutil.rmtree(tmp_path / "ssd")
    monkeypatch.setenv("DTKV_TENANT_KEKS", _kek_text(1, 2, current=2))
    assert main(["tenants", "rotate-keys", f"file://{tmp_path / 'objects'}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rewrapped"] == [ACME.hex()]
    monkeypatch.setenv("DTKV_TENANT_KEKS", _kek_text(2, current=2))  # the old version is gone
    loaded, _ = _restore(tmp_path)
    assert loaded == list(range(10, 16))
