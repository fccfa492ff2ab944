"""``dtkv bench s3`` runs end to end (small sizes) and reports what the issue asks for."""

from __future__ import annotations

import argparse

from infra.s3util import S3Server

from dynamo_tiered_kv.bench import s3 as bench_s3
from dynamo_tiered_kv.commands.bench import format_table

pytest_plugins = ["infra.fixtures_s3"]


def test_bench_s3_small(moto_s3: S3Server) -> None:
    p = argparse.ArgumentParser()
    bench_s3.add_arguments(p)
    args = p.parse_args(["--endpoint", moto_s3.endpoint, "--bucket", "dtkv-bench-test", "--segment-mib", "6",
                         "--record-kib", "512", "--prefixes", "2", "--part-mib", "5", "--repeats", "1"])
    res = bench_s3.run(args)
    for k in ("put_gbps", "raw_put_gbps", "get_gbps", "raw_get_gbps", "put_ratio", "get_ratio"):
        assert res[k] > 0, k
    assert res["gets_per_prefix"] == 1.0 and res["prefixes"] == 2
    assert "put_ratio" in format_table(res)
