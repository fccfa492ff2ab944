"""``dtkv bench agentic`` / ``dtkv bench tiers``: report, tables and plots on synthetic results, and the
raw-ceiling part of ``bench tiers --quick`` (no vLLM needed; the engine sessions are benchmarks)."""

from __future__ import annotations

import argparse
import json

import pytest

from dynamo_tiered_kv.bench import tiers
from dynamo_tiered_kv.bench.agentic import report


def _replay(contexts: list[int], ttft: list[float], tier: str | None, first: int = 7) -> list[dict]:
    out = []
    for i, (n, t) in enumerate(zip(contexts, ttft, strict=True)):
        r = {"agent": i % 2, "turn": i // 2 + 1, "context_tokens": n, "ttft_ms": t, "cached_tokens": n - 1,
             "first_token": [first], "save_hook_ms": 0.0, "load_hook_ms": t / 2}
        if tier:
            r.update(read_bytes={tier: n * 6144.0}, served_blocks={tier: n // 64}, restored_tokens=n // 64 * 64)
        out.append(r)
    return out


def _result(object_first_token: int = 7) -> dict:
    ctx = [2000, 4000, 8200, 10000]
    rec = [1000.0, 2500.0, 6000.0, 8000.0]
    live_turns = [{**r, "answer_ms": 10.0} for r in _replay(ctx, [900.0, 300.0, 400.0, 500.0], "host")]
    return {"model": "synthetic", "object_tier": "local directory", "gpu_blocks": 171, "block_size": 64,
            "agents": 2, "turns": 2, "idle_s": 0.1,
            "sessions": {"recompute": {"replay": _replay(ctx, rec, None)},
                         "live": {"replay": _replay(ctx, [50.0, 80.0, 150.0, 180.0], "host"),
                                  "live": {"turns": live_turns, "wall_s": 10.0, "generated_tokens": 68,
                                           "prompt_tokens": sum(ctx)}},
                         "ssd": {"replay": _replay(ctx, [40.0, 70.0, 120.0, 160.0], "ssd")},
                         "object": {"replay": _replay(ctx, [60.0, 90.0, 200.0, 900.0], "object",
                                                      first=object_first_token)}}}


def test_summary_reductions_and_outputs():
    res = _result(object_first_token=9)
    s = report.summarize(res)
    assert s["ssd"]["long_turns"] == 2
    assert s["ssd"]["long_min_reduction"] == pytest.approx(1 - 160 / 8000)
    assert s["object"]["long_min_reduction"] == pytest.approx(1 - 900 / 8000)
    assert s["object"]["same_output"] == 0 and s["ssd"]["same_output"] == 4
    assert s["host"]["bytes_read"] == pytest.approx(sum([2000, 4000, 8200, 10000]) * 6144)
    # bytes over time in the load hooks (half the TTFT in this synthetic data)
    assert s["ssd"]["rows"][0]["restore_gbps"] == pytest.approx(2000 * 6144 / 0.020 / 1e9)
    assert s["live"]["rows"][0]["gpu_hit_tokens"] == 1999 - 1984


def test_tables_headline_and_plots(tmp_path):
    res = _result()
    res["summary"] = report.summarize(res)
    text = report.format_tables(res)
    assert "object" in text and "98.0%" in text  # ssd's 160 ms vs 8000 ms recompute
    md = report.markdown(res)
    assert md.count("\n| ") >= 4 + 4 + 4 and "| ssd | 4 |" in md
    h = report.headline(res)
    assert h["ssd_ttft_reduction_min_8k"] == pytest.approx(0.98)
    json.dumps(h)
    pytest.importorskip("matplotlib")
    paths = report.plot(res, tmp_path)
    assert [p.name for p in paths] == ["agentic_ttft.png", "agentic_speedup.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tiers_quick_raw_paths(tmp_path):
    """``bench tiers --quick --skip-engine``: every raw data path measured with its ceiling (moto for S3)."""
    p = argparse.ArgumentParser()
    tiers.add_arguments(p)
    args = p.parse_args(["--quick", "--skip-engine", "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "ssd"),
                         "--s3-endpoint", ""])
    args.json = True
    res = tiers.run(args)
    assert len(res["paths"]) == 8
    for name, v in res["paths"].items():
        assert v["gbps"] > 0 and v["ceiling_gbps"] > 0, name
        assert v["ratio"] == pytest.approx(v["gbps"] / v["ceiling_gbps"])
    assert "S3" in tiers.format_tables(res)
    assert json.loads((tmp_path / "out" / "tiers.json").read_text())["paths"].keys() == res["paths"].keys()


def test_tiers_engine_table_format():
    row = {"context_tokens": 8192, "kv_mb": 50.3, "recompute_ms": 7000.0, "example_store_ms": 400.0,
           "dtkv_store_ms": 40.0, "store_speedup": 10.0, "dtkv_save_hook_ms": 10.0, "store_engine_speedup": 40.0,
           "example_restore_ttft_ms": 300.0, "example_restore_warm_ttft_ms": 100.0,
           "dtkv_restore_ttft_ms": 60.0, "restore_ttft_speedup": 5.0, "example_restore_load_ms": 250.0,
           "dtkv_restore_load_ms": 20.0, "restore_load_speedup": 12.5, "same_output": {"example": True, "dtkv": True}}
    text = tiers.format_tables({"engine": {"model": "m", "rows": [row]}})
    assert "10.0x" in text and "40.0x" in text and "12.5x" in text and "yes" in text
