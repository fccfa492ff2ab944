"""``dtkv bench soak`` for a few seconds: the report's shape, restores from every tier, 0 wrong bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo_tiered_kv.bench.soak import drift, flatness
from dynamo_tiered_kv.cli import main


def test_short_soak_reports_samples_series_and_no_wrong_bytes(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "soak.json"
    argv = ["bench", "soak", "--seconds", "4", "--interval-s", "0.5", "--sessions", "3", "--host-mib", "2",
            "--ssd-mib", "4", "--object-mib", "8", "--gc-every-s", "1", "--dir", str(tmp_path),
            "--json", str(out_file), "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    res = json.loads(out_file.read_text())
    assert "flat" in table and "wrong bytes 0" in table
    assert res["wrong_bytes"] == 0 and res["session_errors"] == []
    assert res["turns"] > 0 and res["blocks_restored"] > 0 and res["restored_bytes"] > 0
    assert len(res["samples"]) >= 3
    for name in ("rss_mib", "open_files", "threads", "host_used_mib", "ssd_used_mib", "object_used_mib",
                 "retention_host", "retention_ssd", "admission_keys", "ssd_index_kib"):
        assert name in res["series"] and {"mean", "drift_pct", "flat"} <= set(res["series"][name])
    assert isinstance(res["all_flat"], bool)
    assert res["removed_by_medium"].get("CPU_PINNED", 0) > 0  # the small host tier evicted
    assert [p.name for p in tmp_path.iterdir()] == ["soak.json"]  # its tier directories are removed
    # hinted sessions (the default): every turn planned and applied, some hostile, the tables sampled
    assert res["hinted_turns"] == res["turns"] and res["hostile_turns"] > 0
    for name in ("hint_scopes", "retained_host", "retention_heap_ssd", "hint_turn_ms_p50", "hint_turn_ms_p99"):
        assert name in res["series"]
    assert max(s["retained_host"] for s in res["samples"]) > 0  # kv.retain reached the store


def test_flatness_is_the_fitted_drift_after_warm_up() -> None:
    assert drift([1.0, 2.0, 3.0]) == pytest.approx(2.0)
    grow = [{"t_s": i, "x": 100.0 + 10 * i, "y": 50.0 + (i % 2)} for i in range(9)]
    s = flatness(grow)  # warm-up: the first 3 samples
    assert s["x"]["drift"] == pytest.approx(50.0) and not s["x"]["flat"]
    assert s["y"]["flat"]  # alternating by one unit: no drift
