"""The S3 server's read ceiling in ``bench tiering`` (``raw_s3``): plain parallel ranged GETs by
curl, against a real S3 server (moto), every byte accounted for."""

from __future__ import annotations

import shutil

import boto3
import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.bench.tiering import raw_s3

pytest_plugins = ["infra.fixtures_s3"]
pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
MiB = 1 << 20


def _client(s3: S3Server):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                        aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key)


def test_ranged_gets_read_every_byte_of_every_object_once(moto_s3: S3Server) -> None:
    s3, bucket = _client(moto_s3), unique_bucket("raw")
    s3.create_bucket(Bucket=bucket)
    size = 3 * MiB + 5  # the last range is short
    keys = raw_s3.upload(s3, bucket, "p", 3, size)

    got = raw_s3.read_once(s3, bucket, keys, size, piece=MiB, parallel=4)
    assert got["bytes"] == 3 * size and got["gets"] == 3 * 4
    assert got["gbps"] > 0 and got["cpu_s"] >= 0

    run = raw_s3.read_run(s3, bucket, keys, size)
    assert len(run["tries"]) == len(raw_s3.SHAPES)
    assert run["gbps"] == max(t["gbps"] for t in run["tries"])
    assert {t["gets"] for t in run["tries"]} >= {3}  # whole objects: one GET each


def test_a_missing_object_fails_the_run_rather_than_reporting_a_rate(moto_s3: S3Server) -> None:
    s3, bucket = _client(moto_s3), unique_bucket("raw")
    s3.create_bucket(Bucket=bucket)
    keys = raw_s3.upload(s3, bucket, "p", 2, MiB)
    with pytest.raises(RuntimeError, match="raw GETs failed"):
        raw_s3.read_once(s3, bucket, [*keys, "p/absent"], MiB, piece=MiB // 2, parallel=2)
