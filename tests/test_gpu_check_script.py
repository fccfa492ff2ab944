"""``scripts/gpu-check`` cannot pass vacuously: run on a CPU machine against a stand-in interpreter
(``PYTHON``) that plays torch with CUDA, the GDS probe, pytest, the benchmark and the GPU probe, it
passes only when the verdict, every gpu-marked test file, the benchmark and the probe pass, and fails
on a skipped GPU test, a compat-mode verdict, a verdict that disagrees with nvidia_fs, a benchmark
that cannot import and a probe that cannot run.
Everything the stand-in does not play (the script's own report checks) runs on the real interpreter.
``scripts/gpu-wheels`` runs on a machine without ``.venv``."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"
MARKER = re.compile(r"(^|[^A-Za-z_.])(pytest\.)?mark\." + "gpu" + r"\b", re.MULTILINE)

FAKE_PYTHON = r'''#!{python}
"""Stand-in interpreter for scripts/gpu-check; behaviour from FAKE_* variables, the rest is real."""
import os, sys

args = sys.argv[1:]
env = os.environ.get


def real() -> None:
    os.execv({python!r}, [{python!r}, *args])


if args[:1] == ["-c"] and args[1].startswith("# gpu-check: prerequisites") and env("FAKE_PREREQS") != "real":
    print("torch 2.9.0+cu128, CUDA 12.8, NVIDIA H200 (stand-in)")
    sys.exit(0)
if args[:1] == ["-c"] and args[1].startswith("# gpu-check: gds probe"):
    verdict = env("FAKE_VERDICT", "gpudirect")
    if verdict == "crash":
        sys.exit("Traceback (most recent call last):\nRuntimeError: the probe crashed")
    print(f"verdict: {{verdict}}")
    print("reason: stand-in")
    sys.exit(0)
if args[:2] == ["-m", "pytest"]:
    if env("FAKE_TESTS") == "real":
        real()
    xml_path = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
    files = [a for a in args if a.endswith(".py")]
    cases = []
    for i, f in enumerate(files):
        module = f[:-3].replace("/", ".")
        if env("FAKE_TESTS") == "file_without_tests" and i == 0:
            continue
        cases.append(f'<testcase classname="{{module}}" name="test_on_gpu" time="0.1" />')
        if env("FAKE_TESTS") == "skip" and i == 0:
            cases.append(f'<testcase classname="{{module}}" name="test_needs_cuda" time="0.0">'
                         '<skipped type="pytest.skip" message="needs CUDA">needs CUDA</skipped></testcase>')
        if env("FAKE_TESTS") == "gds_skip" and i == 0:
            cases.append(f'<testcase classname="{{module}}" name="test_gds_round_trip_on_gpu" time="0.0">'
                         '<skipped type="pytest.skip" message="GPUDirect Storage not usable here: compat">'
                         '</skipped></testcase>')
    with open(xml_path, "w") as out:
        out.write('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                  + "".join(cases) + "</testsuite></testsuites>")
    print(f"{{len(cases)}} passed in 1.00s")
    sys.exit(0)
if args[:2] == ["-m", "dynamo_tiered_kv.cli"]:
    if env("FAKE_BENCH") == "noimport":  # the real command, on an image where torch cannot import
        code = ("import sys; sys.modules['torch'] = None\n"
                "from dynamo_tiered_kv.cli import main\n"
                "sys.exit(main(sys.argv[1:]))")
        os.execv({python!r}, [{python!r}, "-c", code, *args[2:]])
    print("gpudirect bench table (stand-in)")
    sys.exit(0)
if args[:1] == ["tests/gpu_copy_table.py"]:
    print("copy table (stand-in)")
    sys.exit(0)
if args[:2] == ["-m", "pip"]:
    sys.exit(0)
if args == ["-"]:  # scripts/gpu-probe/run.sh's environment listing (gpu-check's report checks pass arguments)
    sys.stdin.read()
    print("probe environment (stand-in)")
    sys.exit(0)
if args[:1] == ["scripts/gpu-probe/probe.py"]:
    if env("FAKE_PROBE") == "dry":  # the real probe's dry run, through gpu-check's environment
        os.execv({python!r}, [{python!r}, *args, "--cpu"])
    if env("FAKE_PROBE") == "crash":
        print("Traceback (most recent call last):")
        print("ImportError: cannot import name 'codec' from 'dynamo_tiered_kv'")
        sys.exit(1)
    print("[probe] 5 sections, 0 raised (stand-in)")
    sys.exit(0)
real()
'''


def gpu_marked_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if MARKER.search(p.read_text()) and "e2e" not in p.parts)


@pytest.fixture
def rig(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    nvfs = tmp_path / "proc-nvidia-fs"
    nvfs.write_text("stand-in for /proc/driver/nvidia-fs\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTKV_", "FAKE_", "DYN_TIERED_KV_"))}
    env.update(PYTHON=str(fake), OUT=str(tmp_path / "out"), DTKV_GPU_CHECK_NVFS_PATHS=str(nvfs))
    return env


def gpu_check(tmp_path: Path, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "ssd")], capture_output=True, text=True,
                          env={**env, **extra}, timeout=600, cwd=tmp_path)


def test_passes_when_all_is_well(tmp_path: Path, rig: dict[str, str]) -> None:
    out = gpu_check(tmp_path, rig)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith(f"gpu-check: PASS (outputs in {tmp_path / 'out'})")
    assert "ok: GPUDirect Storage, nvidia_fs loaded" in out.stdout
    listed = (tmp_path / "out" / "gpu-test-files.txt").read_text().split()
    assert listed == gpu_marked_files()
    assert "tests/test_deferred_encode.py" in listed and "tests/test_kernels.py" in listed
    assert f"gpu tests: {len(listed)} passed, 0 failed or errors, 0 skipped" in out.stdout
    assert "[probe] 5 sections, 0 raised (stand-in)" in (tmp_path / "out" / "probe.txt").read_text()
    assert "probe environment (stand-in)" in (tmp_path / "out" / "probe-env.txt").read_text()


def test_a_skipped_gpu_test_fails(tmp_path: Path, rig: dict[str, str]) -> None:
    out = gpu_check(tmp_path, rig, FAKE_TESTS="skip")
    assert out.returncode == 1, out.stdout
    assert "tests.test_deferred_encode::test_needs_cuda skipped: needs CUDA" in out.stdout
    assert "gpu-check: FAIL: tests" in out.stdout


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the real GPU checks, which pass on this machine")


@cpu_only
def test_every_gpu_test_skipping_on_a_cpu_machine_fails(tmp_path: Path, rig: dict[str, str]) -> None:
    """The real tests on this CPU machine: each skips, and the check says which and why."""
    out = gpu_check(tmp_path, rig, FAKE_TESTS="real")
    assert out.returncode == 1, out.stdout
    assert out.stdout.count("skipped: needs a CUDA GPU") >= len(gpu_marked_files())
    assert "no gpu test of this file passed" in out.stdout
    assert "gpu-check: FAIL: tests" in out.stdout


def test_a_file_without_a_passing_test_fails(tmp_path: Path, rig: dict[str, str]) -> None:
    out = gpu_check(tmp_path, rig, FAKE_TESTS="file_without_tests")
    assert out.returncode == 1
    assert f"FAIL: {gpu_marked_files()[0]}: no gpu test of this file passed" in out.stdout


def test_compat_verdict_fails_unless_expected(tmp_path: Path, rig: dict[str, str]) -> None:
    out = gpu_check(tmp_path, rig, FAKE_VERDICT="compat")
    assert out.returncode == 1
    assert "FAIL (gds): verdict 'compat' where GPUDirect Storage is expected" in out.stdout
    assert "gpu-check: FAIL: gds" in out.stdout


def test_compat_verdict_passes_when_the_operator_expects_it(tmp_path: Path, rig: dict[str, str]) -> None:
    """No nvidia_fs, DTKV_GDS_EXPECTED=compat: the GDS round trips may skip, nothing else."""
    absent = str(tmp_path / "no-nvidia-fs")
    out = gpu_check(tmp_path, rig, FAKE_VERDICT="compat", DTKV_GDS_EXPECTED="compat",
                    DTKV_GPU_CHECK_NVFS_PATHS=absent, FAKE_TESTS="gds_skip")
    assert out.returncode == 0, out.stdout
    assert "ok: verdict compat, as expected (nvidia_fs absent)" in out.stdout
    assert "allowed: tests.test_" in out.stdout and "GPUDirect Storage not usable here" in out.stdout
    out = gpu_check(tmp_path, rig, FAKE_VERDICT="compat", DTKV_GDS_EXPECTED="compat",
                    DTKV_GPU_CHECK_NVFS_PATHS=absent, FAKE_TESTS="skip")
    assert out.returncode == 1  # any other skip still fails


def test_verdict_must_agree_with_nvidia_fs(tmp_path: Path, rig: dict[str, str]) -> None:
    out = gpu_check(tmp_path, rig, DTKV_GPU_CHECK_NVFS_PATHS=str(tmp_path / "no-nvidia-fs"))
    assert out.returncode == 1
    assert "the verdict claims GPUDirect Storage but nvidia_fs is not loaded" in out.stdout
    out = gpu_check(tmp_path, rig, FAKE_VERDICT="compat", DTKV_GDS_EXPECTED="compat")
    assert out.returncode == 1
    assert "nvidia_fs is loaded, so GPUDirect Storage should work here" in out.stdout


def test_a_probe_without_a_verdict_fails(tmp_path: Path, rig: dict[str, str]) -> None:
    out = gpu_check(tmp_path, rig, FAKE_VERDICT="crash")
    assert out.returncode == 1
    assert "verdict 'unknown'" in out.stdout


def test_a_bench_that_cannot_import_fails(tmp_path: Path, rig: dict[str, str]) -> None:
    out = gpu_check(tmp_path, rig, FAKE_BENCH="noimport")
    assert out.returncode == 1
    assert "FAIL (bench): dtkv bench gpudirect exited" in out.stdout
    assert "gpu-check: FAIL: bench" in out.stdout


def test_a_probe_that_cannot_run_fails_the_check_loudly(tmp_path: Path, rig: dict[str, str]) -> None:
    """The probe measures and judges nothing, but one that cannot import fails the check."""
    out = gpu_check(tmp_path, rig, FAKE_PROBE="crash")
    assert out.returncode == 1, out.stdout
    assert "ImportError: cannot import name 'codec'" in out.stdout
    assert "FAIL (probe): scripts/gpu-probe/run.sh exited 1" in out.stdout
    assert f"gpu-check: FAIL: probe (outputs in {tmp_path / 'out'})" in out.stdout


def test_the_check_runs_the_real_probe_in_its_environment(tmp_path: Path, rig: dict[str, str]) -> None:
    """The probe's dry run through gpu-check and run.sh: the paths they set up reach the package."""
    out = gpu_check(tmp_path, rig, FAKE_PROBE="dry")
    assert out.returncode == 0, out.stdout + out.stderr
    probe = (tmp_path / "out" / "probe.txt").read_text()
    assert "[probe] 5 sections, 0 raised" in probe and "[B3] device records" in probe, probe
    assert f"work dir {tmp_path / 'ssd' / 'probe'}" in probe


@cpu_only
def test_missing_prerequisites_are_named_up_front(tmp_path: Path, rig: dict[str, str]) -> None:
    """The real check on this CPU machine: torch has no CUDA; nothing else runs."""
    out = gpu_check(tmp_path, rig, FAKE_PREREQS="real")
    assert out.returncode == 2
    assert re.search(r"missing: torch with CUDA: torch \S+ sees no CUDA device", out.stdout), out.stdout
    assert "=== GDS verdict" not in out.stdout


def test_tmpfs_directory_is_refused(tmp_path: Path, rig: dict[str, str]) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or subprocess.run(["stat", "-f", "-c", "%T", str(shm)], capture_output=True,
                                          text=True).stdout.strip() != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this machine")
    where = shm / f"dtkv-gpu-check-{os.getpid()}"
    try:
        out = subprocess.run(["bash", str(SCRIPT), str(where)], capture_output=True, text=True, env=rig, timeout=120)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    assert out.returncode == 2
    assert "is on tmpfs: give a directory on the disk under test" in out.stdout


def test_gpu_wheels_runs_without_a_venv(tmp_path: Path) -> None:
    """A fresh GPU machine's checkout has no .venv: pip comes from python3 on PATH."""
    repo = tmp_path / "checkout"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu-wheels", repo / "scripts" / "gpu-wheels")
    calls = tmp_path / "calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    out = subprocess.run(["bash", "scripts/gpu-wheels"], cwd=repo, capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = calls.read_text().splitlines()
    assert lines[0] == "-m pip --version"
    assert [ln.split()[:3] for ln in lines[1:]] == [["-m", "pip", "download"]] * 2
    assert "nixl==1.5.1" in lines[1] and "pytest-timeout==2.4.0" in lines[1] and "nvidia-cufile" in lines[2]
