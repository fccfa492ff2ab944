"""``dtkv bench sessions --quick``: three policies over one trace, the report's fields, expiry enforced."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dynamo_tiered_kv.bench.sessions import replay as sessions
from dynamo_tiered_kv.bench.sessions.trace import TraceSpec, make_trace, overlap


def test_trace_keeps_the_agent_shape() -> None:
    trace = make_trace(TraceSpec(40, 43, 142_000, 64, 2.0, 4 * 3600.0, 3600.0, seed=1))
    turns = sorted(s.turns for s in trace)
    assert 30 <= turns[len(turns) // 2] <= 56
    assert overlap(trace) > 0.96
    assert all(2.0 <= p <= 4 * 3600.0 for s in trace for p in s.pauses[1:])


def test_quick_run_reports_every_policy(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    sessions.add_arguments(p)
    args = p.parse_args(["--quick", "--no-plots", "--out", str(tmp_path)])
    out = sessions.run(args)
    assert set(out["policies"]) == set(sessions.POLICIES)
    for name, pol in out["policies"].items():
        assert abs(sum(pol["hit_rate"].values()) - 1.0) < 1e-9, name
        assert pol["resumed_turns"] > 0
        assert sum(pol["expired_bytes_left"].values()) == 0, name  # the last GC pass left no expired block
    for name in ("hints", "hints+prefetch"):  # hinted sessions resumed within retention never recompute
        assert out["policies"][name]["within_retention_recomputes"] == 0
    saved = json.loads((tmp_path / "sessions.json").read_text())
    assert saved["trace"]["sessions"] == 6
    assert "hints" in sessions.format_result(out)
