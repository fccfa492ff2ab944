"""The GPUDirect Storage verdict counts only true GPUDirect: cuFile's compatibility mode (POSIX I/O
plus a host copy, what cuFile silently does without nvidia_fs) is forbidden for the probe and
reported as such. A stand-in NIXL agent plays cuFile: it reads the JSON config cuFile would read
when its driver opens, and refuses to open without nvidia_fs once compatibility mode is forbidden."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dynamo_tiered_kv.tiers.ssd import gds_probe
from dynamo_tiered_kv.tiers.ssd import io as ssd_io


class _FakeCuFileAgent:
    nvidia_fs = False
    opened: list[bool] = []  # compat allowed, per driver open

    def __init__(self, *a: Any, **kw: Any) -> None:
        pass

    def create_backend(self, name: str, params: dict) -> None:
        path = os.environ.get(gds_probe.CUFILE_ENV)
        props = json.loads(Path(path).read_text()).get("properties", {}) if path else {}
        compat = props.get("allow_compat_mode", True)  # cuFile's default
        type(self).opened.append(compat)
        if not compat and not self.nvidia_fs:
            raise RuntimeError("cuFileDriverOpen: nvidia-fs driver not loaded and compat mode disabled")


class _FakeNixl:
    nixl_agent = _FakeCuFileAgent

    @staticmethod
    def nixl_agent_config(**kw: Any) -> None:
        return None


@pytest.fixture
def cufile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[_FakeCuFileAgent]:
    monkeypatch.delenv(gds_probe.CUFILE_ENV, raising=False)
    monkeypatch.setattr(ssd_io, "_import_nixl", lambda: _FakeNixl)
    monkeypatch.setattr(gds_probe, "_import_nixl", lambda: _FakeNixl)
    from dynamo_tiered_kv.tiers.ssd import gds

    monkeypatch.setattr(gds, "_import_nixl", lambda: _FakeNixl)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gds_probe, "_libcufile_loads", lambda: True)
    monkeypatch.setattr(gds_probe, "_NVFS_PATHS", (str(tmp_path / "no-nvidia-fs"),))
    monkeypatch.setattr(gds_probe.tempfile, "gettempdir", lambda: str(tmp_path))
    _FakeCuFileAgent.nvidia_fs, _FakeCuFileAgent.opened = False, []
    return _FakeCuFileAgent


def test_compatibility_mode_is_not_gpudirect(cufile: type[_FakeCuFileAgent], tmp_path: Path) -> None:
    verdict = gds_probe.probe_gds(tmp_path)
    assert not verdict.available
    assert verdict.mode == "compat"
    assert "nvidia_fs not loaded" in verdict.reason
    assert cufile.opened == [False]  # cuFile opened with compatibility mode forbidden


def test_true_gpudirect_needs_the_self_test_on_a_registered_slab(cufile: type[_FakeCuFileAgent], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cufile.nvidia_fs = True
    monkeypatch.setattr(gds_probe, "_NVFS_PATHS", (str(tmp_path),))
    stats = tmp_path / "nvfs-stats"
    stats.write_text("Reads : n=0 ok=0 err=0 readMiB=0 io_state_err=0\nWrites : n=0 ok=0 err=0 writeMiB=0\n")
    monkeypatch.setattr(gds_probe, "NVFS_STATS", stats)
    tested: list[Path] = []

    def round_trip(dio: Any, where: Path, nbytes: int) -> None:  # nvidia-fs counts one write and one read
        tested.append(where)
        stats.write_text("Reads : n=1 ok=1 err=0 readMiB=32 io_state_err=0\nWrites : n=1 ok=1 err=0 writeMiB=32\n")

    monkeypatch.setattr(gds_probe, "_self_test", round_trip)
    verdict = gds_probe.probe_gds(tmp_path / "ssd")
    assert verdict.available and verdict.mode == "gpudirect", verdict
    assert tested == [tmp_path / "ssd"] and (tmp_path / "ssd").is_dir()
    assert json.loads(Path(os.environ[gds_probe.CUFILE_ENV]).read_text())["properties"]["allow_compat_mode"] is False

    def failing(dio: Any, where: Path, nbytes: int) -> None:
        raise OSError(5, "read back different bytes")

    monkeypatch.setattr(gds_probe, "_self_test", failing)
    verdict = gds_probe.probe_gds(tmp_path)
    assert not verdict.available and verdict.mode == "none" and "self-test" in verdict.reason


def test_the_strict_config_keeps_the_operators_settings(tmp_path: Path) -> None:
    base = tmp_path / "cufile.json"
    base.write_text('{\n  // the operator\'s\n  "logging": {"level": "ERROR"},\n'
                    '  "properties": {"max_direct_io_size_kb": 16384, "allow_compat_mode": true}\n}\n')
    cfg = gds_probe.strict_config(str(base))
    assert cfg["logging"] == {"level": "ERROR"}
    assert cfg["properties"] == {"max_direct_io_size_kb": 16384, "allow_compat_mode": False}
    assert gds_probe.strict_config(str(tmp_path / "missing.json")) == {"properties": {"allow_compat_mode": False}}


def test_without_cuda_the_verdict_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    verdict = gds_probe.probe_gds()
    assert not verdict.available and verdict.mode == "none"
