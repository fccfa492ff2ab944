"""The ``dtkv`` command line: one configuration language with the connector, one-line errors,
help text on every option."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.cli import build_parser
from dynamo_tiered_kv.cli import main as dtkv
from dynamo_tiered_kv.config import settings_cli
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.objectstore import ObjectTier, S3Backend

pytest_plugins = ["infra.fixtures_s3"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith(("DYN_TIERED_KV_", "DTKV_S3_", "AWS_")) or k == "DTKV_DEBUG":
            monkeypatch.delenv(k)
    # no credentials from this machine's ~/.aws either: the tests say exactly which are used
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(settings_cli, "_warned", set())


# --- help text -----------------------------------------------------------------------------------
def _missing_help(p: argparse.ArgumentParser, path: str) -> list[str]:
    out = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for name, sp in a.choices.items():
                sp.complete()  # a command adds its arguments on first use (commands/_deferred.py)
                if not helps.get(name):
                    out.append(f"{path} {name} (subcommand)")
                out += _missing_help(sp, f"{path} {name}")
        elif a.help is None:  # argparse.SUPPRESS (hidden on purpose) is a string
            out.append(f"{path} {'/'.join(a.option_strings) or a.dest}")
    return out


def _commands() -> list:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_option_has_help(command: str) -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert _missing_help(sub.choices[command], f"dtkv {command}") == []


def test_top_level_options_and_subcommands_have_help() -> None:
    assert [m for m in _missing_help(build_parser(), "dtkv") if m.count(" ") == 1 or "(subcommand)" in m] == []


# --- one-line errors -----------------------------------------------------------------------------
def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynamo_tiered_kv.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.parametrize("where", ["/proc/forbidden", "/proc/self", "/etc/hostname", "/etc/hostname/sub"])
def test_unusable_demo_dir_is_one_line_saying_what_to_do(where: str) -> None:
    """Missing parent, a directory nobody can write, a file, a path below a file."""
    proc = _run_cli("demo", "--dir", where)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dtkv demo: error: --dir {where}: "), proc.stderr
    assert "give a writable directory" in lines[0] and "leave --dir out" in lines[0]
    assert "Traceback" not in proc.stderr


def test_debug_shows_traceback() -> None:
    proc = _run_cli("--debug", "demo", "--dir", "/proc/forbidden")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    proc = _run_cli("demo", "--dir", "/proc/forbidden", env={"DTKV_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_config_typo_in_env_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_SSD_DIRR", "/x")
    assert dtkv(["fsck", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "DYN_TIERED_KV_SSD_DIRR" in err and "did you mean DYN_TIERED_KV_SSD_DIR?" in err


def test_set_typo_suggests(capsys: pytest.CaptureFixture[str]) -> None:
    assert dtkv(["gc", "file:///nonexistent", "--set", "object_ttl=5"]) == 2
    err = capsys.readouterr().err
    assert "object_ttl: unknown setting in --set object_ttl (did you mean object_ttl_s?)" in err


def test_help_imports_no_torch() -> None:
    """``dtkv --help`` and a light command's help stay fast: no command's heavy imports run."""
    code = ("import sys; from dynamo_tiered_kv.cli import main\n"
            "for argv in (['--help'], ['gc', '--help'], ['fsck', '--help']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "print('loaded:', sorted({'torch', 'vllm', 'sglang'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "loaded: []"
    assert "{bench,demo,fsck,gc,plan,tenants}" in out.stdout


def test_fsck_exit_codes_tell_corruption_from_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import dynamo_tiered_kv.tiers.ssd.fsck as ssd_fsck

    (tmp_path / "rank-000").mkdir()

    def broken(path: Path) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(ssd_fsck, "fsck_dir", broken)
    assert dtkv(["fsck", str(tmp_path)]) == 3  # not 1: that means corruption
    assert "dtkv fsck: internal error: RuntimeError: bug" in capsys.readouterr().err
    assert dtkv(["gc", "--set", "object_url=file:///x", "--set", "object_ttl_s=bad"]) == 2
    with pytest.raises(SystemExit) as usage:
        dtkv(["fsck", "--no-such-flag"])
    assert usage.value.code == 2
    with pytest.raises(SystemExit):
        dtkv(["fsck", "--help"])
    helptext = capsys.readouterr().out
    assert "1  corruption found" in helptext and "3  internal error" in helptext


# --- one configuration language ------------------------------------------------------------------
def _fill_bucket(server: S3Server, bucket: str) -> None:
    async def go() -> None:
        tier = ObjectTier(S3Backend(bucket, "kv", **server.backend_kwargs()))
        await tier.open()
        shape = small_shape(num_layers=2)
        recs = [(random_key(i, b"cli"), make_record(random_key(i, b"cli"), i, shape=shape)) for i in range(3)]
        await tier.write_many((k, memoryview(v)) for k, v in recs)
        await tier.close()

    asyncio.run(go())


def test_fsck_and_gc_take_the_connector_env(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bucket = unique_bucket("cli")
    _fill_bucket(moto_s3, bucket)
    monkeypatch.setenv("DYN_TIERED_KV_S3_ENDPOINT_URL", moto_s3.endpoint)
    monkeypatch.setenv("DYN_TIERED_KV_S3_ACCESS_KEY", moto_s3.access_key)
    monkeypatch.setenv("DYN_TIERED_KV_S3_SECRET_KEY", moto_s3.secret_key)
    assert dtkv(["fsck", f"s3://{bucket}/kv"]) == 0
    assert "3 records verified" in capsys.readouterr().out
    # no TARGET: the object_url setting
    monkeypatch.setenv("DYN_TIERED_KV_OBJECT_URL", f"s3://{bucket}/kv")
    assert dtkv(["gc", "--dry-run"]) == 0
    assert "1 manifests" in capsys.readouterr().out


def test_yaml_file_and_flag(moto_s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = unique_bucket("cli")
    _fill_bucket(moto_s3, bucket)
    f = tmp_path / "kv.yaml"
    f.write_text(f"object_url: s3://{bucket}/kv\ns3_access_key: {moto_s3.access_key}\n"
                 f"s3_secret_key: {moto_s3.secret_key}\ns3_endpoint_url: http://127.0.0.1:9\n")
    # the flag beats the file's (unreachable) endpoint
    assert dtkv(["fsck", "--config", str(f), "--s3-endpoint-url", moto_s3.endpoint]) == 0
    assert "3 records verified" in capsys.readouterr().out


def test_deprecated_env_still_works_and_warns_once(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bucket = unique_bucket("cli")
    _fill_bucket(moto_s3, bucket)
    for k, v in moto_s3.env().items():
        monkeypatch.setenv(k, v)
    assert dtkv(["fsck", f"s3://{bucket}/kv"]) == 0
    assert dtkv(["gc", f"s3://{bucket}/kv", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert err.count("DTKV_S3_ENDPOINT is deprecated, use DYN_TIERED_KV_S3_ENDPOINT_URL") == 1


def test_s3_failure_names_endpoint_and_settings(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DYN_TIERED_KV_S3_ENDPOINT_URL", moto_s3.endpoint)
    assert dtkv(["fsck", "s3://bucket/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"cannot reach s3://bucket/x at {moto_s3.endpoint}" in err
    assert "s3_endpoint_url from DYN_TIERED_KV_S3_ENDPOINT_URL" in err
    assert "Unable to locate credentials" in err and "s3_access_key/s3_secret_key" in err


def test_missing_bucket_says_who_creates_it(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in (("ENDPOINT_URL", moto_s3.endpoint), ("ACCESS_KEY", moto_s3.access_key),
                 ("SECRET_KEY", moto_s3.secret_key)):
        monkeypatch.setenv(f"DYN_TIERED_KV_S3_{k}", v)
    assert dtkv(["gc", f"s3://{unique_bucket('none')}/x"]) == 2
    err = capsys.readouterr().err
    assert "s3_access_key from DYN_TIERED_KV_S3_ACCESS_KEY" in err and "create the bucket" in err, err
