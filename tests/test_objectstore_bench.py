"""``dtkv bench s3`` runs end to end (small sizes) and reports its ratios, request counts and ceilings."""

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


def test_bench_index_small(tmp_path) -> None:
    from dynamo_tiered_kv.bench import index as bench_index

    p = argparse.ArgumentParser()
    bench_index.add_arguments(p)
    args = p.parse_args(["--blocks", "3000", "--blocks-per-manifest", "64", "--new-manifests", "3",
                         "--object-url", f"file://{tmp_path}"])
    res = bench_index.run(args)
    assert res["manifests"] == 47 and res["refresh_requests"] >= 3
    assert res["requests_by_namespace"]["A"] > 0 and res["requests_by_namespace"]["B"] == 0
    assert res["requests_for_other_namespace"] == 0
    for k in ("open_snapshot_blocks_per_s", "open_full_listing_blocks_per_s", "store_start_empty_s",
              "store_start_full_s", "store_index_ready_full_s"):
        assert res[k] > 0, k
    assert list(tmp_path.iterdir()) == []  # the run's prefix is removed
