"""``dtkv bench tenants --quick`` end to end: a flooder against quotas, and encryption's cost.

One quick run (real host, SSD and local-directory object tiers through ``build_store``) serves the
checks of its result and of its tables; bad arguments are refused before anything is built.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from dynamo_tiered_kv.bench import report
from dynamo_tiered_kv.cli import main

RUNS = ("quotas-on-clean", "quotas-on-flood", "quotas-off-clean", "quotas-off-flood")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    """The JSON result of one ``--quick`` run, and its stdout (tables) and stderr (progress)."""
    out_file = tmp_path_factory.mktemp("tenants") / "result.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            assert main(["bench", "tenants", "--quick", "--json", str(out_file)]) == 0
    finally:
        report.set_progress(True)  # process-wide
    return json.loads(out_file.read_text()), stdout.getvalue(), stderr.getvalue()


def test_flood_runs_the_four_configurations(quick: tuple[dict[str, Any], str, str]) -> None:
    res = quick[0]["flood"]
    assert set(res["runs"]) == set(RUNS)
    plan = res["plan"]
    assert plan["tenants"][-1] == "flooder" and len(plan["tenants"]) == 4
    for name, run in res["runs"].items():
        rates = [t["hit_rate"] for t in run["tenants"] if not t["flooder"]]
        assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates), name
        assert any(t["flooder"] for t in run["tenants"]) == name.endswith("flood")
    for name in ("quotas-on-clean", "quotas-off-clean"):  # alone, every working set fits: all hits
        assert all(t["hit_rate"] == 1.0 for t in res["runs"][name]["tenants"])
    # the flooder writes far past its quota and the tiers' capacities together
    flooder = res["runs"]["quotas-on-flood"]["tenants"][-1]
    assert flooder["flood_bytes"] > sum(plan["capacities"].values())
    host = flooder["tiers"]["host"]
    assert host["limit"] < host["capacity"] and host["bytes"] <= host["limit"]  # the host quota holds it
    assert 0 < host["retained"] <= host["limit"]  # it retained, within its own share
    tiers = res["runs"]["quotas-on-flood"]["tiers"]
    assert set(tiers) == {"host", "ssd", "object"} and tiers["host"]["capacity"] == plan["capacities"]["host"]
    # without quotas the flood costs the others hits: the baseline shows the problem
    assert min(res["ratios"]["off"].values()) < 0.95
    goal = res["goal"]
    assert goal["target"] == 0.95 and goal["met"] == (goal["worst_ratio"] >= 0.95)


def test_crypto_compares_on_and_off(quick: tuple[dict[str, Any], str, str]) -> None:
    res = quick[0]["crypto"]
    paths = {(r["path"], r["tokens"]) for r in res["rows"]}
    assert paths == {(p, t) for p in ("ssd load", "object load", "ssd write") for t in (256, 1024)}
    for r in res["rows"]:
        assert r["off_gbps"] > 0 and r["on_gbps"] > 0 and r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
    assert res["open_failures"]["ssd-on"] == 0 and res["open_failures"]["object-on"] == 0
    raw = res["raw_cipher"]
    assert raw["all_opened"] and raw["seal_gbps"] > 0 and raw["open_gbps"] > 0


def test_tables_goals_and_load_average(quick: tuple[dict[str, Any], str, str]) -> None:
    res, out, err = quick
    assert "[tenants] " in err and "load average" in err
    assert out.count("goal: ") == 2
    assert "load average at start" in out and "load average at end" in out
    assert len(res["load_avg_start"]) == 3 and len(res["load_avg_end"]) == 3
    assert "hit alone" in out and "on/off" in out and "raw RecordCipher" in out


@pytest.mark.parametrize("argv", [["--tenants", "9"], ["--tenants", "3", "--weights", "1,x"], ["--tokens", "8"],
                                  ["--measures", "flood,disk"], ["--share", "1.5"]])
def test_bad_arguments_are_refused_before_any_work(argv: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tenants", *argv, "--json", str(tmp_path / "r.json")]) == 2
    assert "error: --" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
