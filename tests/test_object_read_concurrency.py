"""``s3_read_concurrency``: parsed from every settings source, handed by the factory to the object
tier (its ranged GETs in flight) and to the S3 backend, whose connection pool then holds the reads
alongside two uploads' parts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.blocks.keys import Namespace
from dynamo_tiered_kv.config import TieredKVConfig, settings_cli
from dynamo_tiered_kv.errors import ConfigError
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.tiers.objectstore import S3Backend, backend_from_url

pytest_plugins = ["infra.fixtures_s3"]

NS = Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)


pytestmark = pytest.mark.usefixtures("no_dtkv_env")


def test_default_and_every_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert TieredKVConfig.from_mapping({}).s3_read_concurrency == 8
    assert TieredKVConfig.from_mapping({"s3_read_concurrency": 3}).s3_read_concurrency == 3
    path = tmp_path / "dtkv.yaml"
    path.write_text("s3_read_concurrency: 4\n")
    assert TieredKVConfig.from_yaml(path).s3_read_concurrency == 4
    monkeypatch.setenv("DYN_TIERED_KV_S3_READ_CONCURRENCY", "32")
    assert TieredKVConfig.from_yaml(path).s3_read_concurrency == 32  # env over the file
    settings = settings_cli.load(argparse.Namespace(settings=["s3_read_concurrency=64"], config=path))
    assert settings.config.s3_read_concurrency == 64  # --set over env
    assert settings.origin_of("s3_read_concurrency") == "--set s3_read_concurrency"
    assert settings.s3_kwargs()["read_concurrency"] == 64  # dtkv gc/fsck size their pool alike


@pytest.mark.parametrize("bad", [0, 257])
def test_out_of_bounds_refused_naming_the_env_var(monkeypatch: pytest.MonkeyPatch, bad: int) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_S3_READ_CONCURRENCY", str(bad))
    with pytest.raises(ConfigError, match=r"s3_read_concurrency \(from DYN_TIERED_KV_S3_READ_CONCURRENCY\)"):
        TieredKVConfig.from_mapping({})


def test_factory_sets_the_object_tiers_reads_in_flight(tmp_path: Path) -> None:
    cfg = TieredKVConfig.from_mapping({"host_capacity_bytes": 0, "object_url": f"file://{tmp_path / 'objects'}",
                                       "object_refresh_s": None, "s3_read_concurrency": 3})
    store = build_store(cfg, NS)
    try:
        (tier,) = store.tiers
        assert tier.name == "object" and tier.max_concurrency == 3
        assert tier._sem._value == 3  # the bound read_many waits on
    finally:
        store.close()


def test_factory_s3_backend_pool_holds_reads_and_uploads(moto_s3: S3Server) -> None:
    bucket = unique_bucket("rc")
    cfg = TieredKVConfig.from_mapping({
        "host_capacity_bytes": 0, "object_url": f"s3://{bucket}/kv", "object_refresh_s": None,
        "s3_endpoint_url": moto_s3.endpoint, "s3_access_key": moto_s3.access_key,
        "s3_secret_key": moto_s3.secret_key, "s3_max_concurrency": 4, "s3_read_concurrency": 40,
    })
    store = build_store(cfg, NS)
    try:
        (tier,) = store.tiers
        backend = tier.root_backend
        assert isinstance(backend, S3Backend)
        assert tier.max_concurrency == 40 and backend.read_concurrency == 40 and backend.max_concurrency == 4
        store._call(backend.open(), timeout=30)  # idempotent: the tier may have opened it already
        pool = backend._client.meta.config.max_pool_connections
        assert pool >= 40 + 2 * 4, pool  # 40 GETs while the flusher uploads two segments' parts
    finally:
        store.close()


async def test_pool_grows_with_read_concurrency_only(moto_s3: S3Server) -> None:
    pools = []
    for reads in (8, 64):
        b = backend_from_url(f"s3://{unique_bucket('rp')}/", read_concurrency=reads, **moto_s3.backend_kwargs())
        await b.open()
        try:
            pools.append(b._client.meta.config.max_pool_connections)
            assert b.max_concurrency == 8  # uploads keep their own bound
        finally:
            await b.close()
    assert pools[1] - pools[0] == 56 and pools[0] >= 8 + 2 * 8


def test_backend_refuses_no_reads() -> None:
    with pytest.raises(ConfigError, match="read_concurrency"):
        S3Backend("bkt", read_concurrency=0)
