"""The benchmarks' HDD mode (``bench.osd_delay``): finding the local Ceph cluster behind a bucket,
applying the per-OSD-op delay through the admin sockets and always putting the values back.

Most tests drive a fake ``ceph`` command on PATH that keeps each socket's options in a JSON file
and logs every call; ``test_real_ceph_*`` (marked ``s3``) runs against the Ceph RGW of the test
fixtures."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.bench import osd_delay
from dynamo_tiered_kv.bench.osd_delay import DURATION, PROBABILITY, OsdDelayError
from dynamo_tiered_kv.cli import main

pytest_plugins = ["infra.fixtures_s3"]
VLLM_033 = Path(__file__).resolve().parents[1] / ".deps" / "vllm-0.33"

FAKE_CEPH = r'''#!{python}
"""A fake `ceph --admin-daemon SOCK config get|set NAME [VALUE]`: options per socket in $FAKE_CEPH_STATE."""
import json, os, sys
state_file, log_file = os.environ["FAKE_CEPH_STATE"], os.environ["FAKE_CEPH_LOG"]
args = sys.argv[1:]
with open(log_file, "a") as f:
    f.write(json.dumps(args) + "\n")
assert args[0] == "--admin-daemon", args
sock, cmd = args[1], args[2:]
if not os.path.exists(sock):
    print("admin_socket: exception getting command descriptions: [Errno 2] No such file or directory",
          file=sys.stderr)
    sys.exit(22)
fail = os.environ.get("FAKE_CEPH_FAIL", "")
if fail and " ".join(cmd).startswith(fail):
    print("injected failure", file=sys.stderr)
    sys.exit(1)
state = json.load(open(state_file)) if os.path.exists(state_file) else {{}}
opts = state.setdefault(sock, {{"{duration}": "0.100000", "{probability}": "0.000000"}})
if cmd[:2] == ["config", "get"]:
    print(json.dumps({{cmd[2]: opts[cmd[2]]}}))
elif cmd[:2] == ["config", "set"]:
    opts[cmd[2]] = "%f" % float(cmd[3])
    json.dump(state, open(state_file, "w"))
    print(json.dumps({{"success": ""}}))
else:
    sys.exit(2)
'''


class FakeCeph:
    """A cluster directory as ``ceph_rgw.sh`` lays it out, and a fake ``ceph`` on PATH."""

    def __init__(self, root: Path, port: int, osds: int = 1) -> None:
        self.dir = root / "dtkv-ceph-fake"
        (self.dir / "run").mkdir(parents=True)
        (self.dir / "ceph.conf").write_text(
            "[global]\nrun dir = x\n[client.rgw.a]\n"
            f"rgw frontends = beast endpoint=127.0.0.1:{port}\nrgw data = x\n")
        self.sockets = [self.dir / "run" / f"osd.{i}.asok" for i in range(osds)]
        for s in [*self.sockets, self.dir / "run" / "client.rgw.a.asok"]:
            s.touch()
        self.state, self.log = root / "state.json", root / "calls.log"
        self.bin = root / "bin"
        self.bin.mkdir()
        script = self.bin / "ceph"
        script.write_text(FAKE_CEPH.format(python=sys.executable, duration=DURATION, probability=PROBABILITY))
        script.chmod(0o755)

    def options(self, sock: Path) -> dict[str, str]:
        return json.loads(self.state.read_text())[str(sock)]

    def sets(self) -> list[tuple[str, str, str]]:
        """(socket, option, value) of every `config set`, in order."""
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [(c[1], c[4], c[5]) for c in calls if c[2:4] == ["config", "set"]]

    def preset(self, sock: Path, **opts: str) -> None:
        state = json.loads(self.state.read_text()) if self.state.exists() else {}
        state[str(sock)] = {DURATION: "0.100000", PROBABILITY: "0.000000", **opts}
        self.state.write_text(json.dumps(state))


def _installed(f: FakeCeph, monkeypatch: pytest.MonkeyPatch) -> FakeCeph:
    monkeypatch.setenv("PATH", f"{f.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CEPH_STATE", str(f.state))
    monkeypatch.setenv("FAKE_CEPH_LOG", str(f.log))
    monkeypatch.delenv("FAKE_CEPH_FAIL", raising=False)
    return f


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCeph:
    return _installed(FakeCeph(tmp_path, 17480, osds=2), monkeypatch)


@pytest.fixture
def fake_behind_moto(moto_s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCeph:
    """A fake cluster whose RGW port is moto's: the benchmarks take moto for that cluster's RGW."""
    return _installed(FakeCeph(tmp_path, int(moto_s3.endpoint.rsplit(":", 1)[1])), monkeypatch)


# ---------------------------------------------------------------- finding the cluster


def test_the_cluster_is_found_by_the_rgw_port_of_the_endpoint(fake: FakeCeph,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ceph = osd_delay.find_local_ceph("http://127.0.0.1:17480", fake.dir)
    assert ceph.dir == fake.dir and ceph.rgw_port == 17480
    assert list(ceph.osd_sockets) == fake.sockets
    assert ceph.rgw_socket == fake.dir / "run" / "client.rgw.a.asok"
    monkeypatch.setenv("DTKV_CEPH_DIR", str(fake.dir))  # searched without --ceph-dir
    assert osd_delay.find_local_ceph("http://localhost:17480").dir == fake.dir


@pytest.mark.parametrize(("endpoint", "message"), [
    (None, "needs an S3 endpoint"),
    ("https://s3.us-east-1.amazonaws.com", "not a loopback address"),
    ("http://127.0.0.1:5000", "not the RGW of a local Ceph cluster"),  # e.g. moto
])
def test_a_bucket_not_on_a_local_ceph_is_a_clear_error(fake: FakeCeph, endpoint: str | None, message: str) -> None:
    with pytest.raises(OsdDelayError, match=message):
        osd_delay.find_local_ceph(endpoint, fake.dir)


def test_a_cluster_without_osd_sockets_is_a_clear_error(fake: FakeCeph) -> None:
    for s in fake.sockets:
        s.unlink()
    with pytest.raises(OsdDelayError, match="no OSD admin socket"):
        osd_delay.find_local_ceph("http://127.0.0.1:17480", fake.dir)


def test_the_benchmarks_exit_with_the_reason(fake: FakeCeph) -> None:
    with pytest.raises(SystemExit, match=r"bench tiering: --osd-op-delay-ms: .*not the RGW"):
        osd_delay.hdd_mode("tiering", "http://127.0.0.1:5000", 8.0, str(fake.dir))
    assert osd_delay.hdd_mode("tiering", "http://127.0.0.1:5000", None) is None  # no flag: nothing checked


# ---------------------------------------------------------------- applying and putting back


def test_the_delay_holds_inside_the_block_and_the_old_values_come_back(fake: FakeCeph) -> None:
    fake.preset(fake.sockets[0], **{DURATION: "0.050000"})  # someone's earlier setting: kept
    ceph = osd_delay.find_local_ceph("http://127.0.0.1:17480", fake.dir)
    with osd_delay.osd_op_delay(ceph, 8) as d:
        for s in fake.sockets:
            assert fake.options(s) == {DURATION: "0.008000", PROBABILITY: "1.000000"}
    assert d.to_dict()["ms_per_op"] == 8
    assert fake.options(fake.sockets[0]) == {DURATION: "0.050000", PROBABILITY: "0.000000"}
    assert fake.options(fake.sockets[1]) == {DURATION: "0.100000", PROBABILITY: "0.000000"}
    # the duration is set before the probability and put back after it: no op ever waits 0.1 s
    for s in fake.sockets:
        names = [n for sock, n, _ in fake.sets() if sock == str(s)]
        assert names == [DURATION, PROBABILITY, PROBABILITY, DURATION]


def test_an_error_inside_the_block_still_puts_the_values_back(fake: FakeCeph) -> None:
    ceph = osd_delay.find_local_ceph("http://127.0.0.1:17480", fake.dir)
    with pytest.raises(ValueError, match="the benchmark failed"), osd_delay.osd_op_delay(ceph, 8):
        raise ValueError("the benchmark failed")
    for s in fake.sockets:
        assert fake.options(s) == {DURATION: "0.100000", PROBABILITY: "0.000000"}


def test_a_failed_set_puts_back_what_was_changed(fake: FakeCeph, monkeypatch: pytest.MonkeyPatch) -> None:
    ceph = osd_delay.find_local_ceph("http://127.0.0.1:17480", fake.dir)
    monkeypatch.setenv("FAKE_CEPH_FAIL", f"config set {PROBABILITY} 1")
    entered = False
    with pytest.raises(OsdDelayError, match="injected failure"), osd_delay.osd_op_delay(ceph, 8):
        entered = True
    assert not entered
    monkeypatch.delenv("FAKE_CEPH_FAIL")
    assert fake.options(fake.sockets[0]) == {DURATION: "0.100000", PROBABILITY: "0.000000"}


def test_a_failed_put_back_is_reported(fake: FakeCeph, monkeypatch: pytest.MonkeyPatch) -> None:
    ceph = osd_delay.find_local_ceph("http://127.0.0.1:17480", fake.dir)
    with pytest.raises(OsdDelayError, match="could not put the OSD delay options back"), \
            osd_delay.osd_op_delay(ceph, 8):
        monkeypatch.setenv("FAKE_CEPH_FAIL", "config set")


@pytest.mark.skipif(signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, reason="SIGTERM handled by the runner")
def test_sigterm_inside_the_block_puts_the_values_back(fake: FakeCeph) -> None:
    ceph = osd_delay.find_local_ceph("http://127.0.0.1:17480", fake.dir)
    with pytest.raises(SystemExit), osd_delay.osd_op_delay(ceph, 8):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert fake.options(fake.sockets[1]) == {DURATION: "0.100000", PROBABILITY: "0.000000"}


def test_request_counts_sum_every_request_kind() -> None:
    from dynamo_tiered_kv.tiers.objectstore.backend import BackendStats

    before = osd_delay.stats_snapshot(BackendStats(gets=3, heads=1))
    after = osd_delay.stats_snapshot(BackendStats(gets=7, heads=2, lists=1, retries=2, hedges_sent=1,
                                                  bytes_read=10**9))
    assert osd_delay.object_requests(before, after) == 4 + 1 + 1 + 2 + 1  # bytes are no requests
    assert osd_delay.per_gb(9, 0.5e9) == 18 and osd_delay.per_gb(9, 0) is None


# ---------------------------------------------------------------- the benchmarks' flags


def _hdd_flags(f: FakeCeph) -> list[str]:
    return ["--osd-op-delay-ms", "8", "--ceph-dir", str(f.dir)]


def _untouched_after(f: FakeCeph) -> None:
    """The delay was applied once and put back on every OSD."""
    for s in f.sockets:
        assert f.options(s) == {DURATION: "0.100000", PROBABILITY: "0.000000"}
        assert [(n, v) for sock, n, v in f.sets() if sock == str(s)] == [
            (DURATION, "0.008000"), (PROBABILITY, "1"), (PROBABILITY, "0.000000"), (DURATION, "0.100000")]


def test_s3_concurrency_reports_requests_per_gb_under_the_delay(
        moto_s3: S3Server, fake_behind_moto: FakeCeph, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "res.json"
    argv = ["bench", "s3_concurrency", "--quick", "--s3-endpoint", moto_s3.endpoint, "--bucket",
            unique_bucket("hdd"), "--s3-read-concurrency", "2", "--staging-slabs", "2", "--dir", str(tmp_path),
            *_hdd_flags(fake_behind_moto), "--json", str(out_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    res = json.loads(out_file.read_text())
    assert res["osd_op_delay"]["ms_per_op"] == 8
    assert res["osd_op_delay"]["osd_sockets"] == [str(s) for s in fake_behind_moto.sockets]
    for lv in res["levels"]:  # every restore reads S3: at least one GET per restored prefix
        assert lv["requests_per_gb"] >= lv["sessions"] / (lv["bytes"] / 1e9)
        assert f"{lv['sessions']} sessions (p50): {lv['requests_per_gb']:.1f} requests per restored GB" in out
    assert "every OSD op delayed 8 ms" in out
    _untouched_after(fake_behind_moto)


def test_restore_store_counts_requests_always_and_delays_only_s3(
        moto_s3: S3Server, fake_behind_moto: FakeCeph, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.access_key)  # the bench's store takes the default chain
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret_key)
    out_file = tmp_path / "res.json"
    argv = ["bench", "restore_store", "--tiers", "objdir,s3", "--blocks", "8", "--repeats", "1", "--s3-endpoint",
            moto_s3.endpoint, "--dir", str(tmp_path), *_hdd_flags(fake_behind_moto), "--json", str(out_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_file.read_text())["tiers"]
    assert rows["objdir"]["osd_op_delay"] is None and rows["s3"]["osd_op_delay"]["ms_per_op"] == 8
    for tier, r in rows.items():  # 8 blocks are one contiguous run: at least one GET per restore
        assert r["requests_per_gb"] >= 1 / (r["mib"] * 2**20 / 1e9)
        assert f"{tier} (median): {r['requests_per_gb']:.1f} requests per restored GB" in out
    _untouched_after(fake_behind_moto)


@pytest.mark.timeout(900)  # a store and a load process, each importing vLLM and torch
@pytest.mark.skipif(not (VLLM_033 / "vllm").is_dir(), reason="vLLM 0.33 sources not in .deps/vllm-0.33")
def test_tiering_reports_restore_time_and_requests_under_the_delay(
        moto_s3: S3Server, fake_behind_moto: FakeCeph, tmp_path: Path) -> None:
    from dynamo_tiered_kv.bench import tiering

    p = argparse.ArgumentParser()
    tiering.add_arguments(p)
    args = p.parse_args(["--quick", "--tiers", "dtkv-s3", "--skip", "churn,flip,lookup,raw", "--dir",
                         str(tmp_path / "t"), "--vllm-path", str(VLLM_033), "--s3-endpoint", moto_s3.endpoint,
                         "--bucket", unique_bucket("hdd"), *_hdd_flags(fake_behind_moto)])
    res = tiering.run(args)
    assert res["failed"] == [] and res["osd_op_delay"]["ms_per_op"] == 8
    (row,) = res["tiers"]
    assert row["found_after_restart"] == 1.0 and row["restore_s"]["min"] > 0
    # the fake RGW socket answers no perf dump: our backend's own counters count the requests
    assert row["requests_counted_by"] == "tier" and row["requests_per_restored_gb"]["min"] > 0
    text = tiering.format_result(res)
    assert f"dtkv-s3 8k (median of runs, requests counted by tier): " \
           f"{row['requests_per_restored_gb']['median']:.1f} requests per restored GB" in text
    assert "every OSD op delayed 8 ms" in text
    _untouched_after(fake_behind_moto)


def test_a_bench_on_moto_refuses_the_delay_before_doing_anything(
        moto_s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no cluster directory of this machine is searched
    monkeypatch.delenv("DTKV_CEPH_DIR", raising=False)
    monkeypatch.delenv("CEPH_DIR", raising=False)
    monkeypatch.setattr(osd_delay, "DEFAULT_CEPH_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bucket = unique_bucket("hdd")
    for argv in (["bench", "s3_concurrency", "--quick", "--bucket", bucket],
                 ["bench", "restore_store", "--tiers", "s3", "--blocks", "8", "--repeats", "1"],
                 ["bench", "tiering", "--tiers", "dtkv-s3", "--bucket", bucket, "--dir", str(tmp_path / "t")]):
        with pytest.raises(SystemExit, match=r"--osd-op-delay-ms: .*not the RGW of a local Ceph cluster"):
            main([*argv, "--s3-endpoint", moto_s3.endpoint, "--osd-op-delay-ms", "8"])
    assert not (tmp_path / "t").exists()


# ---------------------------------------------------------------- the real cluster


@pytest.mark.s3
def test_real_ceph_delays_every_op_and_is_put_back(ceph_s3: S3Server) -> None:
    import asyncio

    from dynamo_tiered_kv.tiers.objectstore import S3Backend

    try:
        ceph = osd_delay.find_local_ceph(ceph_s3.endpoint)
    except OsdDelayError as e:
        pytest.skip(f"the S3 server is not a local cluster of tests/infra/ceph_rgw.sh: {e}")
    before = {s: {n: osd_delay.config_get(s, n) for n in (DURATION, PROBABILITY)} for s in ceph.osd_sockets}
    gets = 5

    async def timed_gets(backend: S3Backend) -> float:
        buf = bytearray(4096)
        t0 = time.perf_counter()
        for _ in range(gets):
            assert await backend.get_range("k", 0, [memoryview(buf)]) == 4096
        return time.perf_counter() - t0

    async def scenario() -> float:
        backend = S3Backend(unique_bucket("osd-delay"), "", **ceph_s3.backend_kwargs())
        await backend.open()
        try:
            await backend.put_object("k", b"x" * 4096)
            with osd_delay.osd_op_delay(ceph, 8):
                assert float(osd_delay.config_get(ceph.osd_sockets[0], DURATION)) == pytest.approx(0.008)
                return await timed_gets(backend)
        finally:
            await backend.delete("k")
            await backend.close()

    took = asyncio.run(scenario())
    # every GET reads the object from the OSD, and each OSD op waited 8 ms
    assert took >= gets * 0.008
    after = {s: {n: osd_delay.config_get(s, n) for n in (DURATION, PROBABILITY)} for s in ceph.osd_sockets}
    assert after == before
