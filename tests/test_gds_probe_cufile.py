"""The GPUDirect probe's evidence: the strict cuFile config is a copy of the operator's own
(``/etc/cufile.json`` or ``CUFILE_ENV_PATH_JSON``) with only compatibility mode turned off; the
verdict counts only round trips that nvidia-fs's counters saw, and reports those counters; the
round trip moves a production-sized slab.

The stand-in cuFile agent is ``test_gds_probe``'s; nvidia-fs's stats file is a file the fake
round trip rewrites the way nvidia-fs would.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gds_probe import _FakeCuFileAgent, cufile  # noqa: F401 - cufile is a fixture

from dynamo_tiered_kv.tiers.ssd import gds_probe

# nvidia-fs's stats file as it reads with its I/O statistics on (rw_stats_enabled 1), and off
STATS_ON = """GDS Version: 1.9.0.20
NVFS statistics(ver: 4.0)
NVFS Driver(version: 2.20.5)
Mellanox PeerDirect Supported: False
IO stats: Enabled, peer IO stats: Disabled
Logging level: info

Active Shadow-Buffer (MiB): 0
Active Process: 1
Reads\t\t\t\t: n={r} ok={r} err=0 readMiB={rm} io_state_err=0
Reads\t\t\t\t: Bandwidth(MiB/s)=0 Avg-Latency(usec)=0
Sparse Reads\t\t\t: n=0 io=0 holes=0 pages=0
Writes\t\t\t\t: n={w} ok={w} err=0 writeMiB={wm} io_state_err=0 pg-cache=0 pg-cache-fail=0 pg-cache-eio=0
Writes\t\t\t\t: Bandwidth(MiB/s)=0 Avg-Latency(usec)=0
Mmap\t\t\t\t: n={m} ok={m} err=0 munmap=0
Bar1-map\t\t\t: n={m} ok={m} err=0 free=0 callbacks=0 active={m} delay-frees=0
Error\t\t\t\t: cpu-gpu-pages=0 sg-ext=0 dma-map=0 dma-ref=0
Ops\t\t\t\t: Read=0 Write=0 BatchIO=0
GPU 0000:1b:00.0  uuid:5a8e0c52-0000-0000-0000-000000000000 : Registered_MiB=64 Cache_MiB=0 max_pinned_MiB=64
"""
STATS_OFF = """NVFS statistics(ver: 4.0)
IO stats: Disabled, peer IO stats: Disabled
Reads\t\t\t\t: err=0 io_state_err=0
Writes\t\t\t\t: err=0 io_state_err=0 pg-cache=0 pg-cache-fail=0 pg-cache-eio=0
Mmap\t\t\t\t: n={m} ok={m} err=0 munmap=0
Bar1-map\t\t\t: n={m} ok={m} err=0 free=0 callbacks=0 active={m} delay-frees=0
Ops\t\t\t\t: Read=0 Write=0 BatchIO=0
"""


def _stats(text: str, **counts: int) -> str:
    return text.format(**{"r": 0, "rm": 0, "w": 0, "wm": 0, "m": 0, **counts})


# --- the strict config ----------------------------------------------------------------------------
OPERATOR = """{
    // the operator's settings: cuFile allows comments like these
    "logging": { "dir": "/var/log/cufile//gds", "level": "ERROR" },   // a path with // in it
    "profile": { "cufile_stats": 3 },
    /* block comments too */
    "properties": {
        "max_direct_io_size_kb": 16384,
        "rdma_dev_addr_list": [ "192.168.0.12", ],
        "allow_compat_mode": true,
    },
    "fs": { "generic": { "posix_unaligned_writes": false } }
}
"""


@pytest.fixture
def operator_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An operator's /etc/cufile.json (at a path of the test's) and no CUFILE_ENV_PATH_JSON."""
    etc = tmp_path / "etc-cufile.json"
    etc.write_text(OPERATOR)
    monkeypatch.delenv(gds_probe.CUFILE_ENV, raising=False)
    monkeypatch.setattr(gds_probe, "OPERATOR_CUFILE", etc, raising=False)
    monkeypatch.setattr(gds_probe.tempfile, "gettempdir", lambda: str(tmp_path))
    return etc


def test_the_strict_config_is_a_copy_of_etc_cufile_json_with_compat_off(operator_config: Path) -> None:
    written = gds_probe.forbid_compat_mode()
    assert os.environ[gds_probe.CUFILE_ENV] == str(written)
    cfg = json.loads(written.read_text())
    assert cfg == {
        "logging": {"dir": "/var/log/cufile//gds", "level": "ERROR"},
        "profile": {"cufile_stats": 3},
        "properties": {"max_direct_io_size_kb": 16384, "rdma_dev_addr_list": ["192.168.0.12"],
                       "allow_compat_mode": False},
        "fs": {"generic": {"posix_unaligned_writes": False}},
    }


def test_cufile_env_path_json_wins_over_etc(operator_config: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine.json"
    mine.write_text('{"properties": {"max_batch_io_size": 64}}')
    monkeypatch.setenv(gds_probe.CUFILE_ENV, str(mine))
    cfg = json.loads(gds_probe.forbid_compat_mode().read_text())
    assert cfg == {"properties": {"max_batch_io_size": 64, "allow_compat_mode": False}}


def test_without_an_operator_config_the_strict_file_holds_only_compat_off(operator_config: Path) -> None:
    operator_config.unlink()
    cfg = json.loads(gds_probe.forbid_compat_mode().read_text())
    assert cfg == {"properties": {"allow_compat_mode": False}}


def test_a_malformed_operator_config_is_reported(operator_config: Path, caplog: pytest.LogCaptureFixture) -> None:
    operator_config.write_text('{"properties": {"allow_compat_mode": tru')
    with caplog.at_level(logging.WARNING, logger=gds_probe.log.name):
        cfg = json.loads(gds_probe.forbid_compat_mode().read_text())
    assert cfg == {"properties": {"allow_compat_mode": False}}
    assert str(operator_config) in caplog.text


# --- nvidia-fs's counters -------------------------------------------------------------------------
def test_nvidia_fs_counters_are_parsed(tmp_path: Path) -> None:
    stats = tmp_path / "stats"
    stats.write_text(_stats(STATS_ON, r=2, rm=64, w=3, wm=96, m=4))
    got = gds_probe.nvfs_counters(stats)
    assert got is not None
    assert got["Reads.n"] == 2 and got["Reads.readMiB"] == 64 and got["Writes.n"] == 3
    assert got["Writes.writeMiB"] == 96 and got["Mmap.n"] == 4 and got["Bar1-map.n"] == 4
    assert got["GPU 0000:1b:00.0  uuid:5a8e0c52-0000-0000-0000-000000000000.Registered_MiB"] == 64
    assert gds_probe.nvfs_counters(tmp_path / "absent") is None


@pytest.fixture
def nvfs(cufile: type[_FakeCuFileAgent], tmp_path: Path,  # noqa: F811 - the fixture of test_gds_probe
         monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """nvidia_fs 'loaded', its stats file at a test path; the round trip (the real one needs a GPU)
    is a stand-in that records its size and rewrites the stats file to ``after``."""
    cufile.nvidia_fs = True
    monkeypatch.setattr(gds_probe, "_NVFS_PATHS", (str(tmp_path),))
    stats = tmp_path / "nvfs-stats"
    monkeypatch.setattr(gds_probe, "NVFS_STATS", stats, raising=False)
    rig: dict[str, Any] = {"stats": stats, "after": None, "sizes": []}

    def round_trip(dio: Any, where: Path, nbytes: int | None = None) -> None:
        rig["sizes"].append(nbytes)
        if rig["after"] is not None:
            stats.write_text(rig["after"])

    monkeypatch.setattr(gds_probe, "_self_test", round_trip)
    return rig


def test_a_round_trip_nvidia_fs_did_not_count_is_not_gpudirect(nvfs: dict[str, Any], tmp_path: Path) -> None:
    nvfs["stats"].write_text(_stats(STATS_ON, m=2))
    nvfs["after"] = _stats(STATS_ON, m=2)  # the bytes went some other way: nothing counted
    verdict = gds_probe.probe_gds(tmp_path / "ssd")
    assert not verdict.available and verdict.mode != "gpudirect", verdict
    assert "nvidia-fs did not count" in verdict.reason
    assert verdict.nvfs_delta == ()


def test_the_verdict_reports_the_counters_that_moved(nvfs: dict[str, Any], tmp_path: Path) -> None:
    nvfs["stats"].write_text(_stats(STATS_ON, m=2))
    nvfs["after"] = _stats(STATS_ON, r=1, rm=32, w=1, wm=32, m=4)
    verdict = gds_probe.probe_gds(tmp_path / "ssd")
    assert verdict.available and verdict.mode == "gpudirect", verdict
    delta = dict(verdict.nvfs_delta or ())
    assert delta["Writes.n"] == 1 and delta["Writes.writeMiB"] == 32
    assert delta["Reads.n"] == 1 and delta["Reads.readMiB"] == 32 and delta["Mmap.n"] == 2
    assert "Writes.writeMiB +32" in verdict.reason and "Reads.readMiB +32" in verdict.reason


def test_writes_alone_are_not_a_round_trip(nvfs: dict[str, Any], tmp_path: Path) -> None:
    nvfs["stats"].write_text(_stats(STATS_ON))
    nvfs["after"] = _stats(STATS_ON, w=1, wm=32)
    verdict = gds_probe.probe_gds(tmp_path / "ssd")
    assert not verdict.available and dict(verdict.nvfs_delta or ()) == {"Writes.n": 1, "Writes.ok": 1,
                                                                         "Writes.writeMiB": 32}


def test_with_io_statistics_off_the_mappings_are_the_evidence(nvfs: dict[str, Any], tmp_path: Path) -> None:
    nvfs["stats"].write_text(_stats(STATS_OFF, m=1))
    nvfs["after"] = _stats(STATS_OFF, m=1)
    assert not gds_probe.probe_gds(tmp_path / "a").available  # nothing mapped: not through nvidia-fs
    nvfs["after"] = _stats(STATS_OFF, m=3)
    verdict = gds_probe.probe_gds(tmp_path / "b")
    assert verdict.available and "I/O statistics are off" in verdict.reason and "Mmap.n +2" in verdict.reason


def test_unreadable_counters_are_no_evidence(nvfs: dict[str, Any], tmp_path: Path) -> None:
    verdict = gds_probe.probe_gds(tmp_path / "ssd")  # nvidia_fs "loaded", its stats file missing
    assert not verdict.available and "not readable" in verdict.reason and verdict.nvfs_delta is None


# --- the round trip's size ----------------------------------------------------------------------
def test_the_round_trip_moves_the_stores_slab_size(nvfs: dict[str, Any], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    nvfs["stats"].write_text(_stats(STATS_ON))
    nvfs["after"] = _stats(STATS_ON, r=1, rm=64, w=1, wm=64)
    assert gds_probe.probe_gds(tmp_path / "a", slab_bytes=64 << 20).available
    gds_probe.probe_gds(tmp_path / "b")
    assert nvfs["sizes"] == [64 << 20, 32 << 20]  # the slab given, else the default staging slab

    from dynamo_tiered_kv import factory
    from dynamo_tiered_kv.config import TieredKVConfig

    asked: list[tuple[Any, int]] = []

    def verdict(directory: Any = None, slab_bytes: int = 0) -> gds_probe.GdsVerdict:
        asked.append((directory, slab_bytes))
        return gds_probe.GdsVerdict(False, "stand-in")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gds_probe, "gds_verdict", verdict)
    cfg = TieredKVConfig.from_mapping({"host_capacity_bytes": 0, "ssd_dir": str(tmp_path / "ssd"),
                                       "ssd_capacity_bytes": 64 << 20, "staging_slab_bytes": 16 << 20})
    assert factory._gpu_direct(cfg) is None
    assert asked == [(cfg.ssd_dir, 16 << 20)]
