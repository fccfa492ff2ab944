"""``dtkv plan``'s HDD spindle model (``plan/spindles.py``): worked examples whose expected values are
derived here from the formulas, the minimality of the answer, monotonicity, the plan's default
target (recompute) and the command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_tiered_kv.cli import main
from dynamo_tiered_kv.errors import ConfigError
from dynamo_tiered_kv.plan import plan, scenario
from dynamo_tiered_kv.plan.model import flops_per_s, prefill_flops, restorable_tokens
from dynamo_tiered_kv.plan.spindles import SpindleModel, SpindleRow, spindles_for

MiB = 2**20


def _check(row: SpindleRow, m: SpindleModel, prefix: float, target: float, requests: int, ops: int,
           largest_request: float) -> None:
    """``row`` against the formulas of docs/PLAN.md, evaluated here from the inputs."""
    seek_term = ops * m.seek_s
    transfer_term = prefix / (m.spindle_gbps * 1e9)
    ops_largest = math.ceil(largest_request / m.stripe_bytes) * m.data_shards
    request_s = m.seek_s + largest_request / ops_largest / (m.spindle_gbps * 1e9)
    floor = math.ceil(requests / m.gets_in_flight) * request_s
    assert (row.requests, row.disk_ops) == (requests, ops)
    assert row.seek_term_s == pytest.approx(seek_term)
    assert row.transfer_term_s == pytest.approx(transfer_term)
    assert row.floor_s == pytest.approx(floor)
    assert floor <= target  # these examples are reachable
    spindles = math.ceil(m.sessions * (seek_term + transfer_term) / target)
    assert row.spindles == spindles
    assert row.restore_s == pytest.approx(max(m.sessions * (seek_term + transfer_term) / spindles, floor))
    assert row.bound == ("latency" if seek_term >= transfer_term else "bandwidth")


def test_replicated_pool_64_mib_prefix_is_bandwidth_bound() -> None:
    """4 GETs of 16 MiB, each 4 stripes of 4 MiB read from one copy: 16 seeks of 8 ms (0.128 s)
    against 64 MiB streamed at 200 MB/s (0.336 s)."""
    m = SpindleModel(seek_s=0.008, spindle_gbps=0.2, get_bytes=16 * MiB, stripe_bytes=4 * MiB, data_shards=1,
                     gets_in_flight=8)
    row = spindles_for(m, 8192, 64 * MiB, 0.1)
    _check(row, m, 64 * MiB, 0.1, requests=4, ops=4 * 4, largest_request=16 * MiB)
    assert row.spindles == 5 and row.bound == "bandwidth"  # ceil(0.4635 / 0.1)


def test_erasure_coded_pool_with_a_short_last_get_is_latency_bound() -> None:
    """EC k=8: every 4 MiB stripe is 8 reads of 512 KiB. 100 MiB + 5 B is 6 whole 16 MiB GETs (32
    ops each) and one of 4 MiB + 5 B (2 stripes: 16 ops); three restores share the pool."""
    m = SpindleModel(seek_s=0.008, spindle_gbps=0.2, get_bytes=16 * MiB, stripe_bytes=4 * MiB, data_shards=8,
                     gets_in_flight=4, sessions=3)
    prefix = 100 * MiB + 5
    row = spindles_for(m, 32768, prefix, 2.0)
    _check(row, m, prefix, 2.0, requests=7, ops=6 * 32 + 16, largest_request=16 * MiB)
    assert row.bound == "latency"


def test_one_get_smaller_than_a_stripe_unstriped_gateway() -> None:
    """Stripe 0: a GET is one op per data shard, whatever its size; 1 MiB prefix in one GET."""
    m = SpindleModel(seek_s=0.01, spindle_gbps=0.1, get_bytes=16 * MiB, stripe_bytes=0, data_shards=2)
    row = spindles_for(m, 256, MiB, 1.0)
    assert (row.requests, row.disk_ops) == (1, 2)
    assert row.floor_s == pytest.approx(0.01 + MiB / 2 / 0.1e9)  # two halves read at once
    assert row.spindles == math.ceil((2 * 0.01 + MiB / 0.1e9) / 1.0) == 1


def test_the_answer_is_the_fewest_spindles_that_meet_the_target() -> None:
    m = SpindleModel(sessions=4)
    for target in (0.5, 1.0, 3.0):
        row = spindles_for(m, 32768, 2e9, target)
        assert row.spindles is not None and row.restore_s is not None and row.restore_s <= target
        if row.spindles > 1:  # one fewer misses it
            assert max(m.sessions * row.busy_s / (row.spindles - 1), row.floor_s) > target


def test_a_target_below_the_floor_needs_more_gets_in_flight_or_smaller_gets() -> None:
    m = SpindleModel(get_bytes=16 * MiB, gets_in_flight=1, data_shards=1)
    row = spindles_for(m, 32768, 128 * MiB, 0.1)  # 8 GETs one after another: 8 x 29 ms > 0.1 s
    one_get = m.request_s(16 * MiB)
    assert row.spindles is None and row.bound == "concurrency"
    assert row.gets_in_flight_needed == math.ceil(8 / math.floor(0.1 / one_get))
    ok = spindles_for(replace(m, gets_in_flight=row.gets_in_flight_needed), 32768, 128 * MiB, 0.1)
    assert ok.spindles is not None  # with that many in flight it is reachable
    short = spindles_for(m, 32768, 128 * MiB, one_get / 2)  # shorter than one GET: no concurrency helps
    assert short.spindles is None and short.bound == "request" and short.gets_in_flight_needed is None


def _n(row: SpindleRow) -> float:
    return math.inf if row.spindles is None else row.spindles


@settings(max_examples=200, deadline=None)
@given(prefix=st.floats(1e6, 1e11), target=st.floats(1e-3, 100), sessions=st.integers(1, 64),
       seek=st.floats(0, 0.02), bw=st.floats(0.05, 0.5), shards=st.integers(1, 12), gif=st.integers(1, 64),
       k=st.floats(1.01, 10))
def test_spindles_grow_with_work_and_shrink_with_time_and_speed(prefix: float, target: float, sessions: int,
                                                                 seek: float, bw: float, shards: int, gif: int,
                                                                 k: float) -> None:
    m = SpindleModel(seek_s=seek, spindle_gbps=bw, data_shards=shards, gets_in_flight=gif, sessions=sessions)
    base = spindles_for(m, 1, prefix, target)
    assert _n(spindles_for(m, 1, prefix, target * k)) <= _n(base)  # a looser target
    assert _n(spindles_for(replace(m, sessions=sessions + 1), 1, prefix, target)) >= _n(base)
    assert _n(spindles_for(replace(m, seek_s=seek * k), 1, prefix, target)) >= _n(base)
    assert _n(spindles_for(replace(m, spindle_gbps=bw * k), 1, prefix, target)) <= _n(base)
    bigger = spindles_for(m, 1, prefix * k, target)
    assert bigger.busy_s >= base.busy_s  # more bytes: never less disk time
    if bigger.spindles is not None and base.spindles is not None:
        assert bigger.spindles >= base.spindles


def test_bad_model_values_are_config_errors() -> None:
    for bad in ({"seek_s": -1}, {"spindle_gbps": 0}, {"get_bytes": 0}, {"data_shards": 0}, {"target_s": 0}):
        with pytest.raises(ConfigError):
            SpindleModel(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- in the plan and on the command line


def test_the_default_target_is_recomputing_the_restored_tokens() -> None:
    """Without a target, a restore may take what recomputing its restored tokens would: its TTFT
    (load + the suffix's compute) then equals the recompute's."""
    s = scenario("default")
    p = plan(s)
    assert [r.tokens for r in p.spindles] == list(s.contexts)
    rate = flops_per_s(s.gpu, p.tp, s.mfu)
    for r in p.spindles:
        restored = restorable_tokens(r.tokens, s.block_size)
        assert r.prefix_bytes == restored // s.block_size * p.stored_bytes_per_block
        assert r.target_s == pytest.approx(prefill_flops(s.model, restored) / rate)
        assert r.restore_s is not None and r.restore_s <= r.target_s


def test_cli_takes_the_measured_request_shape_and_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--restore-target-ms", "2000", "--requests-per-gb", "62.5", "--hdd-data-shards", "1",
            "--restore-sessions", "2", "--context-tokens", "32768"]
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["spindles"]
    assert res["model"]["get_bytes"] == pytest.approx(16e6) and res["model"]["target"] == "given"
    (row,) = res["rows"]
    m = SpindleModel(get_bytes=16e6, data_shards=1, sessions=2, target_s=2.0)
    assert row["spindles"] == spindles_for(m, 32768, row["prefix_bytes"], 2.0).spindles
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "HDD spindles for a restore within the target" in text and "62.5 per GB" in text


def test_cli_rejects_two_request_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--get-mib", "8", "--requests-per-gb", "10"])
    assert "not allowed with argument" in capsys.readouterr().err
