"""``dtkv bench gpudirect`` runs end to end on its CPU stand-in (host memory + NIXL POSIX)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("nixl")


def test_bench_reports_every_path_and_cleans_up(tmp_path: Path) -> None:
    from dynamo_tiered_kv.bench import gpudirect

    p = argparse.ArgumentParser()
    gpudirect.add_arguments(p)
    res = gpudirect.run(p.parse_args(["--device", "cpu", "--dir", str(tmp_path), "--layers", "2", "--blocks", "6",
                                      "--batch", "4", "--repeats", "2"]))
    for path in ("host_encode", "device_encode", "host_decode", "device_decode", "host_offload", "direct_offload",
                 "host_onboard", "direct_onboard"):
        assert res[f"{path}_gbps"] > 0, path
    assert res["direct_offload_vs_host"] == pytest.approx(res["direct_offload_gbps"] / res["host_offload_gbps"])
    assert res["io_backend"] == "POSIX stand-in" and res["bytes"] == 6 * res["record_bytes"]
    assert list(tmp_path.iterdir()) == [], "benchmark files left behind"
