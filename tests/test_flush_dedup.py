"""The flusher does not upload again what the object tier already holds.

Blocks restored or prefetched from the object tier land in new SSD segments; once sealed, such a
segment is marked flushed without a new data object or manifest, unless a record is new to the
object tier or carries a retention its manifest would record.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from infra.segments_fake import FakeSegmentSource

from dynamo_tiered_kv.blocks.keys import BlockKey, Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.hints import BlockRetention
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher
from dynamo_tiered_kv.tiers.objectstore.manifest import Manifest

NS = Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)


pytestmark = pytest.mark.usefixtures("no_dtkv_env")


def _layout(seed: int) -> EngineLayout:
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=16, block_size=16,
                            num_kv_heads=2, head_size=64)
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        t.copy_(torch.randn(t.shape, generator=g))
    return EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 16, 2, 64)


def _config(tmp_path: Path) -> TieredKVConfig:
    return TieredKVConfig.from_mapping({
        "host_capacity_bytes": 8 << 20,
        "ssd_dir": str(tmp_path / "ssd"),
        "ssd_capacity_bytes": 64 << 20,
        "ssd_segment_bytes": 4 << 20,
        "ssd_seal_idle_s": 3600.0,  # sealed by the test only
        "object_url": f"file://{tmp_path / 'objects'}",
        "object_refresh_s": None,
        "staging_slab_bytes": 1 << 20,
        "staging_slabs": 2,
    })


def _objects(tmp_path: Path) -> tuple[list[Path], list[Path]]:
    """(data objects, manifests) in the bucket directory."""
    root = tmp_path / "objects"
    return sorted(root.rglob("data/*.seg")), sorted(root.rglob("manifests/*.json"))


def _seal_and_flush(store: TieredStore) -> None:
    ssd = store.tiers[1]
    assert store.drain(30)  # offloads and promotions written
    store._call(ssd.seal(), timeout=30)
    assert store._call(store.flusher.drain(30), timeout=40)  # type: ignore[attr-defined]


def _offload(store: TieredStore, src: EngineLayout, ids: list[int], keys: list[BlockKey]) -> None:
    assert store.submit_offload(src, ids, keys, parents_of(keys))
    assert store.drain(30)


def _forget_locally(store: TieredStore, keys: list[BlockKey]) -> None:
    """Evict ``keys`` from host and SSD: only the object tier holds them afterwards."""
    for t in store.tiers[:2]:
        store._call(t.delete_many(keys), timeout=30)
    assert store.lookup(keys).tier_per_block == ("object",) * len(keys)


def _wait_ready(store: TieredStore) -> None:
    objects = store.tiers[-1]
    deadline = time.monotonic() + 60
    while not objects.index_ready and time.monotonic() < deadline:  # indexed in the background
        time.sleep(0.05)
    assert objects.index_ready


@contextlib.contextmanager
def _store(tmp_path: Path, ready: bool = False) -> Iterator[TieredStore]:
    """The test's store, closed on exit; ``ready``: once its object index has loaded (a restart)."""
    store = build_store(_config(tmp_path), NS)
    try:
        if ready:
            _wait_ready(store)
        yield store
    finally:
        store.close()


def _loads_back(store: TieredStore, keys: list[BlockKey], src: EngineLayout, src_ids: list[int]) -> None:
    dst = _layout(99)
    ids = list(range(16 - len(keys), 16))
    res = store.load(dst, ids, keys, timeout=30)
    assert list(res.failed_block_ids) == []
    for j in range(2):
        assert np.array_equal(dst.layer_views[j][ids], src.layer_views[j][src_ids])


@pytest.mark.parametrize("promote", ["restore", "prefetch"])
def test_promoted_blocks_are_not_uploaded_again(tmp_path: Path, promote: str) -> None:
    src = _layout(1)
    old = chain_keys(NS, np.arange(16 * 6))[:4]
    with _store(tmp_path) as store:
        # six blocks in the first segment, four of them come back: the new segment's layout differs
        _offload(store, src, [0, 1, 2, 3, 4, 5], chain_keys(NS, np.arange(16 * 6)))
        _seal_and_flush(store)
        data, manifests = _objects(tmp_path)
        assert len(data) == len(manifests) == 1
        objects = store.tiers[-1]
        publishes = objects.stats.objects_published, objects.stats.objects_deduplicated
        _forget_locally(store, old)
        if promote == "restore":  # a resumed session: restored from objects, promoted into host and SSD
            _loads_back(store, old, src, [0, 1, 2, 3])
        else:  # a dtkv.prefetch hint into the SSD tier
            assert store.prefetch_now(old, into=1) == len(old)
        assert store.drain(30)  # promotions written
        ssd = store.tiers[1]
        assert all(ssd.contains(k) for k in old)
        assert not ssd.unflushed_segments()  # the promoted records sit in the open segment
        store._call(ssd.seal(), timeout=30)
        sealed = ssd.unflushed_segments()
        assert len(sealed) == 1
        before = store.flusher.stats  # type: ignore[attr-defined]
        assert store._call(store.flusher.drain(30), timeout=40)  # type: ignore[attr-defined]
        st = store.flusher.stats  # type: ignore[attr-defined]
        assert _objects(tmp_path) == (data, manifests)  # no new data object, no new manifest
        assert (objects.stats.objects_published, objects.stats.objects_deduplicated) == publishes  # no PUT
        assert st.already_stored_segments == before.already_stored_segments + 1
        assert st.already_stored_bytes == before.already_stored_bytes + sealed[0].size
        assert st.flushed_segments == before.flushed_segments
        assert not ssd.unflushed_segments()  # marked flushed: evictable like any flushed segment
        assert "dtkv_flush_already_stored_segments_total 1.0" in _scrape(store)


def test_a_segment_mixing_promoted_and_new_blocks_is_uploaded(tmp_path: Path) -> None:
    src = _layout(1)
    old = chain_keys(NS, np.arange(16 * 4))
    new = chain_keys(NS, np.arange(5000, 5000 + 16 * 3))
    with _store(tmp_path) as store:
        _offload(store, src, [0, 1, 2, 3], old)
        _seal_and_flush(store)
        data, manifests = _objects(tmp_path)
        _forget_locally(store, old)
        _loads_back(store, old, src, [0, 1, 2, 3])  # promoted into the SSD's open segment
        _offload(store, src, [4, 5, 6], new)  # and new blocks beside them
        _seal_and_flush(store)
        data2, manifests2 = _objects(tmp_path)
        assert len(data2) == len(data) + 1 and len(manifests2) == len(manifests) + 1
        st = store.flusher.stats  # type: ignore[attr-defined]
        assert st.already_stored_segments == 0 and st.flushed_segments == 2
    # after a restart both the promoted and the new blocks load, with the SSD kept and wiped
    for wipe in (False, True):
        if wipe:
            shutil.rmtree(tmp_path / "ssd")
        with _store(tmp_path, ready=True) as store:
            assert store.lookup(old + new).num_blocks == 7
            if wipe:
                assert set(store.lookup(old + new).tier_per_block) == {"object"}
            _loads_back(store, old, src, [0, 1, 2, 3])
            _loads_back(store, new, src, [4, 5, 6])
            assert store._call(store.flusher.drain(30), timeout=40)  # type: ignore[attr-defined]
            assert _objects(tmp_path) == (data2, manifests2)  # a restart uploads nothing again


def test_skipped_segment_still_loads_after_a_restart(tmp_path: Path) -> None:
    src = _layout(1)
    old = chain_keys(NS, np.arange(16 * 4))
    with _store(tmp_path) as store:
        _offload(store, src, [0, 1, 2, 3], old)
        _seal_and_flush(store)
        objects = _objects(tmp_path)
        _forget_locally(store, old)
        _loads_back(store, old, src, [0, 1, 2, 3])
        _seal_and_flush(store)
        assert store.flusher.stats.already_stored_segments == 1  # type: ignore[attr-defined]
    with _store(tmp_path, ready=True) as store:  # the SSD copy recovers as flushed: nothing to upload
        assert not store.tiers[1].unflushed_segments()
        assert store.lookup(old).tier_per_block == ("ssd",) * 4
        _loads_back(store, old, src, [0, 1, 2, 3])
        assert store._call(store.flusher.drain(30), timeout=40)  # type: ignore[attr-defined]
        assert _objects(tmp_path) == objects
    shutil.rmtree(tmp_path / "ssd")  # and from the object tier alone: the copy the skip relied on
    with _store(tmp_path, ready=True) as store:
        assert store.lookup(old).tier_per_block == ("object",) * 4
        _loads_back(store, old, src, [0, 1, 2, 3])


def test_a_retained_promoted_block_is_uploaded_with_its_retention(tmp_path: Path) -> None:
    """kv.retain after the first upload: only a new manifest records the new priority and expiry."""
    src = _layout(1)
    old = chain_keys(NS, np.arange(16 * 4))
    with _store(tmp_path) as store:
        _offload(store, src, [0, 1, 2, 3], old)
        _seal_and_flush(store)
        _, manifests = _objects(tmp_path)
        assert Manifest.from_bytes(manifests[0].read_bytes()).retain == ()
        _forget_locally(store, old)
        expiry = time.time() + 3600
        store.retain(old, BlockRetention(70, expiry))  # the session is retained on its return
        assert store.prefetch_now(old, into=1) == len(old)
        _seal_and_flush(store)
        st = store.flusher.stats  # type: ignore[attr-defined]
        assert st.already_stored_segments == 0 and st.flushed_segments == 2
        _, manifests2 = _objects(tmp_path)
        fresh = [m for m in manifests2 if m not in manifests]
        assert len(fresh) == 1
        m = Manifest.from_bytes(fresh[0].read_bytes())
        assert {e.key for e in m.entries} == set(old)
        assert sorted(m.retain) == [(i, 70, expiry) for i in range(len(old))]


async def test_flusher_marks_a_segment_whose_records_are_all_indexed(tmp_path: Path) -> None:
    """Unit level: the same records in a second segment are marked flushed, not uploaded; a
    segment that holds one record the object tier lacks is uploaded as a whole."""
    first = FakeSegmentSource(tmp_path / "a")
    seg, _ = first.add_segment(4, seed=7)
    tier = ObjectTier(LocalDirBackend(tmp_path / "obj"))
    await tier.open()
    await tier.wait_ready()
    try:
        await tier.publish_segment(seg)
        again = FakeSegmentSource(tmp_path / "b")  # same records, another file
        same, _ = again.add_segment(4, seed=7)
        more, _ = again.add_segment(5, seed=8)
        mixed = FakeSegmentSource(tmp_path / "c")
        part, _ = mixed.add_segment(5, seed=7)  # the 4 records above and a fifth one
        listed = sorted(o.name for o in await tier.backend.list(""))
        fl = Flusher(again, tier, scan_interval_s=0.05)
        await fl.start()
        try:
            assert await fl.drain(timeout=30)
        finally:
            await fl.stop()
        assert again.is_flushed(same.segment_id) and again.is_flushed(more.segment_id)
        st = fl.stats
        assert st.already_stored_segments == 1 and st.already_stored_bytes == same.size
        assert st.flushed_segments == 1 and st.flushed_bytes == more.size
        assert tier.stats.objects_published == 2 and tier.stats.objects_deduplicated == 0  # ``same``: no PUT
        after = sorted(o.name for o in await tier.backend.list(""))
        assert len(after) == len(listed) + 2  # the data object and manifest of ``more`` only
        fl = Flusher(mixed, tier, scan_interval_s=0.05)
        await fl.start()
        try:
            assert await fl.drain(timeout=30)
        finally:
            await fl.stop()
        assert fl.stats.flushed_segments == 1 and fl.stats.already_stored_segments == 0
        assert tier.location(part.entries[-1].key) is not None
    finally:
        await tier.close()


def _scrape(store: TieredStore) -> str:
    from prometheus_client import generate_latest

    return generate_latest(store.metrics.registry).decode()
