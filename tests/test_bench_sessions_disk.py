"""``dtkv bench sessions`` counts the SSD's expired bytes on disk (allocated blocks), not index entries."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynamo_tiered_kv.bench import sessions


def test_expired_ssd_bytes_are_counted_on_disk_and_freed(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    sessions.add_arguments(p)
    # a short retention and a roomy SSD, so blocks expire while their records are still on the SSD
    args = p.parse_args(["--quick", "--no-plots", "--out", str(tmp_path), "--retain-s", "600",
                         "--ssd-share", "0.8"])
    out = sessions.run(args)
    for name in ("hints", "hints+prefetch"):
        pol = out["policies"][name]
        assert pol["gc_bytes"] > 0, name  # the expiry passes deleted blocks
        assert pol["expired_bytes_left"]["ssd"] == 0, name  # and their bytes left the disk
        disk = pol["ssd_allocated_bytes"]
        assert 0 < disk["after_final_gc"] <= disk["before_final_gc"], name
    assert "SSD KiB on disk" in sessions.format_result(out)
