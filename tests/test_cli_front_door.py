"""``dtkv`` at the front door: a benchmark starts without the dependencies of the others, a closed
output pipe ends a command quietly, and ``fsck``/``gc`` of an object location that is not there
say so (exit 2) instead of creating it and reporting it clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.cli import EXIT_OUTPUT_CLOSED
from dynamo_tiered_kv.cli import main as dtkv
from dynamo_tiered_kv.commands.bench import find_benches

pytest_plugins = ["infra.fixtures_s3"]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


# --- dtkv bench imports only the bench it runs -----------------------------------------------------
def test_bench_gpudirect_starts_without_aiobotocore() -> None:
    """A CUDA image without aiobotocore (which the S3 and index benches import) still runs
    ``dtkv bench gpudirect``: only that bench is imported."""
    code = ("import sys; sys.modules['aiobotocore'] = None  # import aiobotocore -> ImportError\n"
            "from dynamo_tiered_kv.cli import main\n"
            "try:\n    main(['bench', 'gpudirect', '--help'])\n"
            "except SystemExit as e:\n    print('exit', e.code)\n"
            "print('benches loaded:', sorted(m.split('.')[2] for m in sys.modules\n"
            "      if m.startswith('dynamo_tiered_kv.bench.') and m.count('.') == 2))")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "--blocks" in out.stdout and lines[-2] == "exit 0", out.stdout + out.stderr
    assert lines[-1] == "benches loaded: ['gpudirect', 'report']"


def test_bench_list_is_read_without_imports() -> None:
    code = ("import sys; from dynamo_tiered_kv.cli import main\n"
            "try:\n    main(['bench', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print('loaded:', sorted(m for m in sys.modules if m.startswith('dynamo_tiered_kv.bench.')))")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "loaded: ['dynamo_tiered_kv.bench.report']"
    names = {b.name for b in find_benches()}
    assert {"codec", "ssd", "store", "s3", "gpudirect", "tiers", "agentic", "restore", "interference",
            "sessions", "sglang", "index"} <= names
    assert not {"report", "engine"} & names  # helpers, not benches
    for name in names:
        assert name in out.stdout


# --- a closed pipe ------------------------------------------------------------------------------
def test_closed_output_pipe_ends_quietly() -> None:
    """``dtkv plan | head``: the reader is gone before dtkv writes; no error line, no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "dynamo_tiered_kv.cli", "plan", "--preset", "seed"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == EXIT_OUTPUT_CLOSED == 141


def test_output_to_a_file_is_unchanged(tmp_path: Path) -> None:
    out = tmp_path / "plan.txt"
    with out.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "dynamo_tiered_kv.cli", "plan", "--preset", "seed"],
                              stdout=f, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "scenario seed" in out.read_text()


# --- fsck and gc of a location that is not there ----------------------------------------------------
@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith(("DYN_TIERED_KV_", "DTKV_S3_", "AWS_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("command", [["fsck"], ["gc", "--dry-run"]])
def test_missing_file_url_exits_2_and_creates_nothing(command: list[str], tmp_path: Path, no_env: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    where = tmp_path / "does" / "not" / "exist"
    assert dtkv([command[0], f"file://{where}", *command[1:]]) == 2
    captured = capsys.readouterr()
    assert "clean" not in captured.out
    assert captured.err.strip() == f"dtkv {command[0]}: file://{where}: no such directory {where}"
    assert not (tmp_path / "does").exists()


def test_file_url_naming_a_file_exits_2(tmp_path: Path, no_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_bytes(b"x")
    assert dtkv(["fsck", f"file://{tmp_path / 'f'}"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_existing_empty_file_url_is_clean(tmp_path: Path, no_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert dtkv(["fsck", f"file://{tmp_path}"]) == 0
    assert capsys.readouterr().out.strip().endswith("clean")


def test_fsck_of_a_missing_bucket_exits_2(moto_s3: S3Server, no_env: None, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in (("ENDPOINT_URL", moto_s3.endpoint), ("ACCESS_KEY", moto_s3.access_key),
                 ("SECRET_KEY", moto_s3.secret_key)):
        monkeypatch.setenv(f"DYN_TIERED_KV_S3_{k}", v)
    bucket = unique_bucket("none")
    assert dtkv(["fsck", f"s3://{bucket}/x"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach s3://{bucket}/x" in err and "create the bucket" in err, err


def test_file_url_with_a_host_names_the_form_it_needs(no_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert dtkv(["fsck", "file://relative/dir"]) == 2
    assert "file URL must be file:///absolute/path" in capsys.readouterr().err
