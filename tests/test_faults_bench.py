"""``dtkv bench faults`` in a quick mode: a small prefix stored through the fault proxy into a moto
server the bench starts itself, restored in every proxy mode. Every mode serves no wrong byte
and loses nothing; a delayed or stalled bucket is a miss within the read's first-byte allowance
(a loaded 2-core box: a generous margin); the reference mode serves every block."""

from __future__ import annotations

import argparse

import pytest

from dynamo_tiered_kv.bench import faults
from dynamo_tiered_kv.commands.bench import find_benches

pytestmark = pytest.mark.usefixtures("no_dtkv_env")
MARGIN_S = 1.5


def test_the_bench_is_listed() -> None:
    assert "faults" in {b.name for b in find_benches()}


def test_a_quick_run_reports_every_mode_within_its_bound_and_no_wrong_byte() -> None:
    p = argparse.ArgumentParser()
    faults.add_arguments(p)
    args = p.parse_args(["--tokens", "64", "--delay-s", "10"])
    res = faults.run(args)
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == set(faults.MODES)
    for mode, r in rows.items():
        assert r["blocks"] == 4
        assert r["wrong_bytes"] == 0, (mode, r)
        assert r["lost"] == 0, (mode, r)
        assert r["restored"] + r["recomputed"] == r["blocks"]
        assert r["recompute_budget_s"] is None  # the store's default: no recompute rate
    assert rows["pass"]["restored"] == 4 and rows["pass"]["bound_s"] is None
    for mode in ("delay", "stall", "reset_body"):
        r = rows[mode]
        assert r["recomputed"] == 4, (mode, r)
        assert r["seconds"] < r["bound_s"] + MARGIN_S, (mode, r)
    text = faults.format_result(res)
    assert "reset_body" in text and "wrong B" in text
