"""``dtkv bench sglang`` on a tiny shape: both paths run, the pages round-trip, JSON and table agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang 0.5.23 not installed (bash .ci/install-sglang.sh)")


def test_bench_sglang_json_and_table(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "dynamo_tiered_kv.cli", "bench", "sglang", "--pages", "8", "--layers", "2",
            "--heads", "2", "--head-dim", "64", "--repeats", "1", "--dir", str(tmp_path), "--no-progress"]
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["sglang"] == "0.5.23" and res["page_bytes"] == 2 * 2 * 16 * 2 * 64 * 2
    rows = {(r["tier"], r["layout"]): r for r in res["rows"]}
    assert set(rows) == {(t, x) for t in ("host", "ssd") for x in ("page_first", "page_first_direct")}
    assert rows[("host", "page_first_direct")]["compiled_path"] and not rows[("host", "page_first")]["compiled_path"]
    for r in rows.values():
        assert r["set_gbps"] > 0 and r["get_gbps"] > 0 and r["raw_write_gbps"] > 0 and r["raw_read_gbps"] > 0
        assert r["set_vs_raw"] == pytest.approx(r["set_gbps"] / r["raw_write_gbps"])
    table = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr[-2000:]
    assert "page_first_direct" in table.stdout and "raw read" in table.stdout
    assert not list(tmp_path.iterdir())  # work files removed
