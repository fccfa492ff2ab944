"""``dtkv bench tiering --quick``: our tier and vLLM's ``fs`` tier under vLLM 0.33's manager, each
phase in its own process, on real files (O_DIRECT where the filesystem takes it)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dynamo_tiered_kv.bench import tiering

VLLM_033 = Path(__file__).resolve().parents[2] / ".deps" / "vllm-0.33"


@pytest.mark.timeout(1800)  # about a dozen processes, each importing vLLM and torch
@pytest.mark.skipif(not (VLLM_033 / "vllm").is_dir(), reason="vLLM 0.33 sources not in .deps/vllm-0.33")
def test_quick_run_compares_ours_with_vllm_fs_tier(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    tiering.add_arguments(p)
    args = p.parse_args(["--quick", "--tiers", "dtkv,fs", "--dir", str(tmp_path), "--vllm-path", str(VLLM_033),
                         "--lookup-keys", "300"])
    res = tiering.run(args)

    by = {r["tier"]: r for r in res["tiers"]}
    assert set(by) == {"dtkv", "fs"}
    for r in by.values():  # stored in one process, found and loaded byte-exact in another
        assert r["stored_share"] == 1.0 and r["found_after_restart"] == 1.0
        assert r["wrong_bytes_loaded"] == 0
        assert r["load_gbps"]["min"] > 0 and r["store_gbps"]["min"] > 0
        assert r["lookup"]["keys"] == 300
        assert r["lookup"]["hits"] == r["prefixes_per_run"] * r["chunks_per_prefix"]
    ours = by["dtkv"]["flip"]
    assert ours["flipped"] >= ours["chunks"] > 0  # one flipped byte in every record on the SSD
    assert ours["returned_wrong"] == 0 and ours["returned_ok"] == 0  # every flip caught: nothing bad loaded
    assert by["fs"]["flip"]["flipped"] == by["fs"]["flip"]["chunks"]  # one per chunk file

    churn = {c["tier"]: c for c in res["churn"]}
    assert churn["dtkv"]["written_bytes"] >= 3 * churn["dtkv"]["capacity_bytes"]
    assert churn["dtkv"]["disk_bytes"] <= 1.25 * churn["dtkv"]["capacity_bytes"]  # the capacity holds
    assert churn["fs"]["disk_bytes"] >= churn["fs"]["written_bytes"]  # vLLM's fs tier has no capacity

    (t,) = res["targets"]  # run i of ours over run i of fs: one ratio per run
    assert t["load_ratio_range"]["min"] > 0 and t["store_ratio_range"]["min"] > 0
    assert t["load_ratio"] == pytest.approx(by["dtkv"]["load_gbps_runs"][0] / by["fs"]["load_gbps_runs"][0])

    text = tiering.format_result(res)
    assert "dtkv" in text and "fs" in text and "churn" in text
