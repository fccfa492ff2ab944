"""`dtkv plan`: the seed reproduction, KV byte counts, the TTFT model's anchors, monotonicity,
and the command line (tables, JSON, errors)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_tiered_kv.blocks.codec import record_bytes
from dynamo_tiered_kv.cli import main
from dynamo_tiered_kv.errors import ConfigError
from dynamo_tiered_kv.plan import format_text, plan, scenario, to_dict
from dynamo_tiered_kv.plan.hardware import GIB, TB, dram_tier, gpu, hdd_tier, ssd_tier
from dynamo_tiered_kv.plan.model import (
    Scenario,
    auto_tp,
    minutes_of_context,
    prefill_flops,
    restore_seconds,
    ttft_row,
)
from dynamo_tiered_kv.plan.models import ModelSpec, preset
from dynamo_tiered_kv.plan.scenarios import SEED_FIGURES, SEED_TOLERANCE_MIN

# ---------------------------------------------------------------- the seed study's figures


def test_seed_reproduces_h100_minutes():
    p = plan(scenario("seed"))
    assert p.tier("HBM").minutes == pytest.approx(SEED_FIGURES["HBM"], abs=SEED_TOLERANCE_MIN["HBM"])
    assert p.tier("HBM").minutes == pytest.approx(1.2, rel=1e-9)  # 72 GiB at 1 GiB/s: exactly 72 s


def test_seed_reproduces_1tb_dram_minutes():
    dram = plan(scenario("seed")).tier("DRAM")
    assert dram.minutes == pytest.approx(SEED_FIGURES["DRAM"], abs=SEED_TOLERANCE_MIN["DRAM"])
    assert dram.minutes_raw == pytest.approx(16.0, rel=1e-9)  # the seed's engine-KV accounting
    assert dram.minutes < dram.minutes_raw  # our 4 KiB record headers cost a little capacity


def test_seed_assumptions_are_printed():
    text = format_text(plan(scenario("seed")))
    for needle in ("Llama-3.1-8B", "8,192", "gpu_memory_utilization 0.9", "1 TiB", "64 GiB", "weights not counted"):
        assert needle in text


def test_seed_needs_its_dram_assumption():
    """With the same 90% share of 1 TiB as of HBM, 1.2 min per 80 GiB gives 15.4 min, not ~16."""
    seed = scenario("seed")
    same_share = replace(dram_tier(1024, reserve_gib=0), usable_fraction=0.9)
    dram = plan(replace(seed, tiers=(same_share,), ttft_gpus=())).tier("DRAM")
    assert dram.minutes_raw == pytest.approx(1.2 * 1024 / 80)
    assert abs(dram.minutes_raw - SEED_FIGURES["DRAM"]) > SEED_TOLERANCE_MIN["DRAM"]


# ---------------------------------------------------------------- bytes per token


def test_llama_8b_bf16_bytes_per_token():
    assert preset("Llama-3.1-8B").kv_bytes_per_token() == 131072


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Qwen2.5-7B", 57344), ("Llama-3.1-70B", 327680), ("Mistral-7B", 131072), ("DeepSeek-V3", 61 * 576 * 2)],
)
def test_preset_bytes_per_token(name, expected):
    assert preset(name).kv_bytes_per_token() == expected


def test_fp8_halves_kv_bytes():
    m = preset("Llama-3.1-8B")
    assert m.with_dtype("fp8").kv_bytes_per_token() * 2 == m.kv_bytes_per_token()


def test_stored_bytes_come_from_the_codec():
    m = preset("Llama-3.1-8B")
    block = m.stored_bytes_per_block(16)
    assert block == record_bytes(m.block_shape(16))
    assert block == 16 * 131072 + 4096  # 2 MiB payload + one 4 KiB header page
    assert m.stored_bytes_per_token(16) > m.kv_bytes_per_token()


def test_tp_splits_gqa_heads_and_replicates_mla():
    llama = preset("Llama-3.1-70B")
    assert llama.kv_bytes_per_token(8) == llama.kv_bytes_per_token(1)  # 8 KV heads over 8 ranks
    assert llama.kv_bytes_per_token(16) == 2 * llama.kv_bytes_per_token(1)  # heads replicated past 8
    ds = preset("DeepSeek-V3")
    assert ds.kv_bytes_per_token(4) == 4 * ds.kv_bytes_per_token(1)  # latent on every rank


def test_mla_one_copy_stores_one_record_per_block():
    ds = preset("DeepSeek-V3")
    assert ds.stored_bytes_per_block(16, 8) == 8 * ds.stored_bytes_per_block(16, 8, mla_one_copy=True)
    llama = preset("Llama-3.1-70B")  # GQA shards are distinct: nothing to dedupe
    assert llama.stored_bytes_per_block(16, 8, mla_one_copy=True) == llama.stored_bytes_per_block(16, 8)
    s = replace(scenario("default"), model=ds, gpu=gpu("H200"), ttft_gpus=())
    assert plan(replace(s, mla_one_copy=True)).tier("SSD").minutes == pytest.approx(
        plan(s).tp * plan(s).tier("SSD").minutes, rel=1e-9
    )


# ---------------------------------------------------------------- TTFT model


def test_prefill_flops_formula():
    m = preset("Llama-3.1-8B")
    t = 1000
    assert prefill_flops(m, t) == pytest.approx(2 * 8.03e9 * t + 32 * 32 * 256 * t * (t + 1))


def test_recompute_matches_a_published_anchor():
    """dynamo#6101: Llama-3.1-8B, 20K tokens, H100 prefill about 0.9 s."""
    s = replace(scenario("default"), contexts=(20000,))
    row = ttft_row(s, gpu("H100"), 20000)
    assert row.tp == 1
    assert row.recompute_s == pytest.approx(0.9, rel=0.25)


def test_restore_beats_recompute_on_long_prompts_from_fast_tiers():
    row = ttft_row(scenario("default"), gpu("H100"), 131072)
    assert row.reduction("DRAM") > 0.9
    assert row.recompute_s / row.restore_s["SSD"] > 5


def test_auto_tp_fits_weights():
    assert auto_tp(preset("Llama-3.1-8B"), gpu("H100")) == 1
    assert auto_tp(preset("Llama-3.1-70B"), gpu("H100")) == 4
    assert auto_tp(preset("Llama-3.1-405B"), gpu("H100")) >= 16


def test_cost_is_capacity_times_price():
    p = plan(scenario("default"))
    ssd = p.tier("SSD")
    assert ssd.usd_month == pytest.approx(ssd.capacity_bytes / 1e9 * ssd.price_gb_month)
    hbm = p.tier("HBM")
    assert hbm.usd_month == pytest.approx(2.50 * 730)  # one H100's rent


# ---------------------------------------------------------------- monotonicity


@settings(max_examples=60, deadline=None)
@given(
    cap=st.floats(1e9, 1e15),
    extra=st.floats(1e6, 1e15),
    rate=st.floats(1.0, 1e6),
    bpt=st.floats(1e3, 1e7),
)
def test_more_capacity_more_minutes(cap, extra, rate, bpt):
    assert minutes_of_context(cap + extra, rate, bpt) > minutes_of_context(cap, rate, bpt)


@settings(max_examples=30, deadline=None)
@given(small=st.floats(1, 4096), factor=st.floats(1.01, 8))
def test_more_dram_more_minutes_in_a_plan(small, factor):
    base = scenario("default")

    def minutes(gib: float) -> float:
        s = replace(base, tiers=(dram_tier(gib, reserve_gib=0), ssd_tier(), hdd_tier()), ttft_gpus=())
        return plan(s).tier("DRAM").minutes

    assert minutes(small * factor) > minutes(small)


@settings(max_examples=60, deadline=None)
@given(
    nbytes=st.floats(1e6, 1e12),
    bw=st.floats(0.1, 1000),
    factor=st.floats(1.01, 100),
    latency=st.floats(0, 1),
    compute=st.floats(0, 10),
)
def test_higher_bandwidth_lower_restore_ttft(nbytes, bw, factor, latency, compute):
    assert restore_seconds(nbytes, bw * factor, latency, compute) < restore_seconds(nbytes, bw, latency, compute)


@settings(max_examples=30, deadline=None)
@given(gbps=st.floats(0.5, 50), factor=st.floats(1.01, 10), tokens=st.integers(17, 200_000))
def test_faster_ssd_never_slower_in_a_plan(gbps, factor, tokens):
    base = scenario("default")

    def ssd_ttft(g: float) -> float:
        s = replace(base, tiers=(dram_tier(), ssd_tier(read_gbps=g), hdd_tier()))
        return ttft_row(s, gpu("H100"), tokens).restore_s["SSD"]

    fast, slow = ssd_ttft(gbps * factor), ssd_ttft(gbps)
    assert fast <= slow
    if gbps * factor <= gpu("H100").host_link_gbps:  # below the host-link cap it is strict
        assert fast < slow


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 500_000))
def test_recompute_grows_faster_than_linear(tokens):
    m = preset("Llama-3.1-70B")
    assert prefill_flops(m, 2 * tokens) > 2 * prefill_flops(m, tokens)


# ---------------------------------------------------------------- invalid scenarios


def test_scenario_validation():
    base = scenario("default")
    with pytest.raises(ConfigError, match="tokens-per-s"):
        replace(base, tokens_per_s=0)
    with pytest.raises(ConfigError, match="mfu"):
        replace(base, mfu=1.5)
    with pytest.raises(ConfigError, match="layers"):
        ModelSpec("bad", 0, 8, 128, 32, 1e9)
    with pytest.raises(ConfigError, match="MLA"):
        ModelSpec("bad", 4, 8, 128, 32, 1e9, mla=True)


def test_weights_that_do_not_fit_are_an_error():
    s = replace(scenario("default"), model=preset("Llama-3.1-70B"), tp=1)
    with pytest.raises(ConfigError, match="do not fit"):
        plan(s)


# ---------------------------------------------------------------- command line


def test_cli_seed_table(capsys):
    assert main(["plan", "--preset", "seed"]) == 0
    out = capsys.readouterr().out
    assert "HBM" in out and "DRAM" in out and "HDD-S3" in out
    assert "1.20" in out and "15.97" in out
    assert "Assumptions" in out


def test_cli_json_parses(capsys):
    assert main(["plan", "--preset", "seed", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tiers = {t["name"]: t for t in doc["tiers"]}
    assert tiers["HBM"]["minutes"] == pytest.approx(1.2)
    assert tiers["DRAM"]["minutes_raw_kv"] == pytest.approx(16.0)
    assert doc["kv_bytes_per_token"] == 131072
    assert {r["gpu"] for r in doc["ttft"]} == {"H100", "H200", "B200", "L40S", "A100"}
    assert doc["assumptions"]


def test_cli_70b_and_overrides(capsys):
    argv = ["plan", "--model", "Llama-3.1-70B", "--gpu", "H100", "--gpus", "H100", "--context-tokens", "8192,131072"]
    argv += ["--dram-gb", "2048", "--ssd-tb", "61.44", "--price", "ssd=0.08", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tp"] == 4
    assert [r["tokens"] for r in doc["ttft"]] == [8192, 131072]
    ssd = next(t for t in doc["tiers"] if t["name"] == "SSD")
    assert ssd["capacity_bytes"] == pytest.approx(61.44 * TB)
    assert ssd["usd_per_month"] == pytest.approx(61.44e3 * 0.08)
    dram = next(t for t in doc["tiers"] if t["name"] == "DRAM")
    assert dram["capacity_bytes"] == 2048 * GIB


def test_cli_custom_shape_matches_preset(capsys):
    assert main(["plan", "--layers", "32", "--kv-heads", "8", "--head-size", "128", "--q-heads", "32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_bytes_per_token"] == 131072
    assert any("estimated" in a for a in doc["assumptions"])


def test_seed_preset_overrides_are_declared(capsys):
    assert main(["plan", "--preset", "seed", "--tokens-per-s", "16384", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    hbm = next(t for t in doc["tiers"] if t["name"] == "HBM")
    assert hbm["minutes"] == pytest.approx(0.6)
    assert any("--tokens-per-s" in a for a in doc["assumptions"])


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "nope"], "unknown preset"),
        (["--gpu", "Z9000"], "unknown"),
        (["--layers", "32"], "needs all of"),
        (["--model", "Llama-3.1-8B", "--layers", "32", "--kv-heads", "8", "--head-size", "128"], "either"),
        (["--mfu", "1.5"], "mfu"),
        (["--model", "Llama-3.1-70B", "--tp", "1"], "do not fit"),
    ],
)
def test_cli_invalid_input_is_a_clear_error(capsys, argv, needle):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtkv plan: error:") and needle in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--context-tokens", "abc"], "token counts"),
        (["--tokens-per-s", "-5"], "must be > 0"),
        (["--price", "tape=1"], "tier must be one of"),
        (["--dtype", "int3"], "invalid choice"),
    ],
)
def test_cli_bad_flag_values_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_json_has_no_infinities():
    s = replace(scenario("default"), tiers=(dram_tier(), ssd_tier(), hdd_tier(capacity_tb=0)))
    doc = to_dict(plan(s))
    text = json.dumps(doc, allow_nan=False)  # raises on inf/nan
    assert json.loads(text)["tiers"][3]["usd_per_month_per_context_hour"] is None
    assert all(math.isfinite(t["minutes"]) for t in doc["tiers"])


def test_scenario_is_frozen():
    s: Scenario = scenario("seed")
    with pytest.raises(AttributeError):
        s.tokens_per_s = 1  # type: ignore[misc]
