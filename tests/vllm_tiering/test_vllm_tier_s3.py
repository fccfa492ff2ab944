"""DynamoTieredKVTier with the object tier on S3: moto always, Ceph RGW when one is available
(``DTKV_S3_ENDPOINT`` exported, or radosgw installed; else those cases skip)."""

from __future__ import annotations

import time
from pathlib import Path

import boto3
import numpy as np
import pytest
from infra.s3util import S3Server, count_slab_takes, unique_bucket
from tiering_engine import Engine, keys, payload
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium
from vllm.v1.metrics.cache_hit_source import CacheHitSource

pytest_plugins = ["infra.fixtures_s3"]

HIT = LookupResult.HIT


@pytest.fixture(params=["moto_s3", pytest.param("ceph_s3", marks=pytest.mark.s3)])
def s3(request: pytest.FixtureRequest) -> dict[str, object]:
    server: S3Server = request.getfixturevalue(request.param)
    bucket = unique_bucket("vt")
    boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                 aws_secret_access_key=server.secret_key, region_name="us-east-1").create_bucket(Bucket=bucket)
    return {"object_url": f"s3://{bucket}/kv", "s3_endpoint_url": server.endpoint, "s3_access_key": server.access_key,
            "s3_secret_key": server.secret_key, "staging_slab_bytes": 256 << 10, "staging_slabs": 4}


def _wait_index(eng: Engine) -> None:
    objects = eng.tier.store.tiers[-1]
    end = time.monotonic() + 30
    while not objects.index_ready:  # type: ignore[attr-defined]  # built in the background at start
        assert time.monotonic() < end, "object index not ready"
        time.sleep(0.05)


def test_object_tier_alone_is_a_remote_tier_that_survives_restart(s3: dict[str, object]) -> None:
    ks = keys(4)
    first = Engine.start(s3)
    assert first.tier.locality is Locality.REMOTE
    assert first.tier.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED
    first.store(ks)
    first.stop()
    again = Engine.start(s3)
    try:
        _wait_index(again)
        assert again.lookup(ks) == [HIT] * 4
        assert all(np.array_equal(again.read(k), payload(k)) for k in ks)
    finally:
        again.stop()


def test_another_node_restores_what_this_node_flushed(tmp_path: Path, s3: dict[str, object]) -> None:
    """Node A: SSD + S3 (SSD written, S3 fed by the flusher). Node B: its own empty SSD, same
    bucket: it finds A's chunks through the shared object tier. A announces both residencies."""
    ks = keys(5)
    a = Engine.start({**s3, "ssd_dir": str(tmp_path / "a"), "ssd_segment_bytes": 1 << 20}, engine_id=None)
    a.store(ks)
    a.settle()
    a.tier.store.persist(30)  # seal the open segment and upload it
    with a.manager.lock:
        ours = [e for e in a.manager.take_events() if e.ownership is not None]
    a.stop()
    where = {(e.medium, e.locality, e.ownership) for e in ours}
    assert where == {(Medium.STORAGE, Locality.LOCAL, "DynamoTieredKVTier/ssd"),
                     (Medium.STORAGE, Locality.REMOTE, "DynamoTieredKVTier/object")}
    assert all(sorted(e.keys) == sorted(ks) for e in ours if not e.removed)
    b = Engine.start({**s3, "ssd_dir": str(tmp_path / "b"), "ssd_segment_bytes": 1 << 20})
    try:
        _wait_index(b)
        assert b.lookup(ks) == [HIT] * 5
        assert all(np.array_equal(b.read(k), payload(k)) for k in ks)
    finally:
        b.stop()


def test_object_chunks_load_straight_into_vllms_rows(s3: dict[str, object]) -> None:
    """A load from S3 receives each GET's body straight into vLLM's rows (no staging slab and
    scatter copy) and verifies the chunks there."""
    ks = keys(6)
    first = Engine.start(s3)
    first.store(ks)
    first.stop()
    again = Engine.start(s3)
    try:
        _wait_index(again)
        taken = count_slab_takes(again.tier.store.staging)
        assert again.lookup(ks) == [HIT] * 6
        assert taken[0] == 0
        assert all(np.array_equal(again.read(k), payload(k)) for k in ks)
        assert again.tier.store.metrics.value("tier_hits", tier="object") == 6
    finally:
        again.stop()
