"""``dtkv bench s3_concurrency --quick`` runs end to end: concurrent sessions restore their prefixes
from the object tier through the store, beside plain ranged GETs of the same bytes, and every
level reports both throughputs, their ratio, restore percentiles and the read concurrency used."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.bench import s3_concurrency
from dynamo_tiered_kv.cli import main
from dynamo_tiered_kv.tiers.objectstore import S3Backend

pytest_plugins = ["infra.fixtures_s3"]


def _remaining(moto_s3: S3Server, bucket: str) -> list[str]:
    import asyncio

    async def listing() -> list[str]:
        b = S3Backend(bucket, **moto_s3.backend_kwargs())
        await b.open()
        try:
            return [o.name for o in await b.list("")]
        finally:
            await b.close()

    return asyncio.run(listing())


def test_quick_run_reports_every_level_against_the_raw_reads(moto_s3: S3Server, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    bucket = unique_bucket("s3conc")
    out_file = tmp_path / "res.json"
    argv = ["bench", "s3_concurrency", "--quick", "--s3-endpoint", moto_s3.endpoint, "--bucket", bucket,
            "--s3-read-concurrency", "4", "--staging-slabs", "2", "--dir", str(tmp_path), "--json", str(out_file)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "[s3_concurrency] " in err and "store/raw" in out  # progress on stderr, the table on stdout
    res = json.loads(out_file.read_text())
    assert res["s3_read_concurrency"] == 4 and res["staging_slabs"] == 2
    assert res["tokens"] == 64 and res["blocks_per_session"] == 4
    assert res["raw_piece_bytes"] > 0 and res["s3_first_byte_timeout_s"] > 0
    assert [lv["sessions"] for lv in res["levels"]] == [2, 4]
    for lv in res["levels"]:
        assert lv["bytes"] == lv["sessions"] * res["bytes_per_session"]
        for k in ("gbps", "raw_gbps", "ratio", "p50_ms", "p99_ms", "raw_p50_ms", "raw_p99_ms"):
            assert lv[k] > 0, k
        assert lv["p99_ms"] >= lv["p50_ms"] and lv["raw_p99_ms"] >= lv["raw_p50_ms"]
        assert lv["failed_blocks"] == 0
    assert _remaining(moto_s3, bucket) == []  # the run's objects are deleted
    assert [p.name for p in tmp_path.iterdir()] == ["res.json"]  # and its scratch SSD directory


def test_bad_levels_are_refused() -> None:
    p = argparse.ArgumentParser()
    s3_concurrency.add_arguments(p)
    with pytest.raises(ValueError, match="--sessions"):
        s3_concurrency.run(p.parse_args(["--sessions", "0,8"]))
    with pytest.raises(ValueError, match="--tokens"):
        s3_concurrency.run(p.parse_args(["--tokens", "8"]))
