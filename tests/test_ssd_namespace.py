"""Tier-level verification checks the whole identity, namespace included."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.keys import KEY_BYTES, Namespace
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.testing.records import TEST_NAMESPACE
from dynamo_tiered_kv.tiers.ssd import SSDTier

SHAPE = small_shape(num_layers=2)
OTHER_TENANT = hashlib.blake2b(b"another tenant", digest_size=KEY_BYTES).digest()


async def _read(t: SSDTier, key: bytes) -> int | None:
    n = t.size_of(key)
    return None if n is None else await t.read_into(key, memoryview(bytearray(n)))


async def test_foreign_namespace_under_the_same_key_is_a_miss(tmp_path: Path) -> None:
    mine, theirs = random_key(1, b"ns"), random_key(2, b"ns")
    t = SSDTier(tmp_path, capacity_bytes=16 << 20, segment_bytes=256 << 10, idle_seal_s=None, io="buffered",
                verify_reads=True, namespace=TEST_NAMESPACE)
    await t.open()
    try:
        await t.write_many([(mine, memoryview(make_record(mine, 1, shape=SHAPE))),
                            (theirs, memoryview(make_record(theirs, 2, shape=SHAPE, namespace=OTHER_TENANT)))])
        assert await _read(t, mine) is not None
        assert await _read(t, theirs) is None  # same key bytes, another tenant's record: never served
        assert not t.contains(theirs)
    finally:
        await t.close()
    t = SSDTier(tmp_path, capacity_bytes=16 << 20, idle_seal_s=None, io="buffered", verify_reads=True)
    await t.open()
    try:
        assert await _read(t, mine) is not None  # without a namespace the key alone is checked (as before)
    finally:
        await t.close()


@pytest.mark.usefixtures("no_dtkv_env")
def test_build_store_gives_the_ssd_tier_its_namespace(tmp_path: Path) -> None:
    ns = Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)
    cfg = TieredKVConfig.from_mapping({"host_capacity_bytes": 0, "ssd_dir": str(tmp_path / "ssd"),
                                       "ssd_capacity_bytes": 64 << 20, "ssd_segment_bytes": 1 << 20,
                                       "staging_slab_bytes": 1 << 20, "staging_slabs": 2})
    store = build_store(cfg, ns)
    try:
        [ssd] = [t for t in store.tiers if isinstance(t, SSDTier)]
        assert ssd.namespace == ns.digest
    finally:
        store.close()
