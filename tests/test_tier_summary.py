"""At start the store logs one line: what each tier will hold, and whether each value is a setting
or the default (``factory.tier_summary``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.keys import Namespace
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store, tier_summary

NS = Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)


pytestmark = pytest.mark.usefixtures("no_dtkv_env")


def test_build_store_logs_one_line_of_tiers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = TieredKVConfig.from_mapping({
        "host_capacity_bytes": "8Mi", "ssd_dir": str(tmp_path / "ssd"), "ssd_capacity_bytes": "64Mi",
        "ssd_segment_bytes": "1Mi", "object_url": f"file://{tmp_path / 'objects'}", "object_refresh_s": None,
        "staging_slab_bytes": "1Mi", "staging_slabs": 2,
    })
    with caplog.at_level(logging.INFO, logger="dynamo_tiered_kv.factory"):
        store = build_store(cfg, NS)
    try:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered KV store:")]
        assert len(lines) == 1
        line = lines[0]
        assert "\n" not in line
        assert "host 8 MiB [host_capacity_bytes] for 15min [default host_ttl_s]" in line
        assert f"SSD {tmp_path / 'ssd'} [ssd_dir] 64 MiB [ssd_capacity_bytes] for 1d [default ssd_ttl_s]" in line
        assert (f"objects file://{tmp_path / 'objects'} [object_url] up to 100 TiB [default object_capacity_bytes], "
                "expired by dtkv gc after 14d [default object_ttl_s]") in line
    finally:
        store.close()


def test_tiers_off_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_HOST_CAPACITY_BYTES", "0")
    line = tier_summary(TieredKVConfig.from_mapping({"object_url": "s3://bucket/kv", "object_ttl_s": 3600}))
    assert line.startswith("tiered KV store: host off: host_capacity_bytes set to 0; SSD off: ssd_dir not set; ")
    assert line.endswith("expired by dtkv gc after 1h [object_ttl_s]")
