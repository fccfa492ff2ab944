"""The shared tier conformance suite for ObjectTier over a local directory, moto and Ceph RGW."""

from __future__ import annotations

from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.testing import TierConformanceTests
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend

pytest_plugins = ["infra.fixtures_s3"]


class TestObjectTierLocalDir(TierConformanceTests):
    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> ObjectTier:
        return ObjectTier(LocalDirBackend(tmp_path / "objects"), capacity_bytes=capacity_bytes)

    async def reopen_tier(self, tier: ObjectTier, tmp_path: Path, capacity_bytes: int) -> ObjectTier:
        await tier.close()
        t = await self.make_tier(tmp_path, capacity_bytes)
        await t.open()
        assert await t.wait_ready(30)  # open() returns at once; the index builds in the background
        return t


class _S3Conformance(TierConformanceTests):
    server_fixture = "moto_s3"

    @pytest.fixture(autouse=True)
    def _server(self, request: pytest.FixtureRequest) -> None:
        self.server: S3Server = request.getfixturevalue(self.server_fixture)
        self.buckets: dict[Path, str] = {}

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> ObjectTier:
        bucket = self.buckets.setdefault(tmp_path, unique_bucket())
        backend = S3Backend(bucket, "kv/", **self.server.backend_kwargs())
        return ObjectTier(backend, capacity_bytes=capacity_bytes)

    async def reopen_tier(self, tier: ObjectTier, tmp_path: Path, capacity_bytes: int) -> ObjectTier:
        await tier.close()
        t = await self.make_tier(tmp_path, capacity_bytes)
        await t.open()
        assert await t.wait_ready(30)  # open() returns at once; the index builds in the background
        return t


class TestObjectTierMoto(_S3Conformance):
    server_fixture = "moto_s3"


@pytest.mark.s3
class TestObjectTierCeph(_S3Conformance):
    server_fixture = "ceph_s3"
