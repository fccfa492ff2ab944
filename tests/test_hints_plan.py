"""Per-block retention plans: coverage, expiry arithmetic, release, the prefix clamp, and a
brute-force per-token reference on random directives."""

from __future__ import annotations

import math
import random

import pytest

from dynamo_tiered_kv.hints import BlockRetention, RetainDirective, plan_retention

NOW = 1_000_000.5
D = RetainDirective
B = BlockRetention


def _plan(directives, *, bs=16, prompt, output=0, now=NOW, num_blocks=None):
    return plan_retention(directives, block_size=bs, num_prompt_tokens=prompt, num_output_tokens=output,
                          now=now, num_blocks=num_blocks)


def test_range_protects_the_blocks_it_covers_with_expiry_now_plus_duration():
    plan = _plan([D(70, 0, 64, duration=86_400.0)], prompt=100)
    assert plan.num_blocks == 6
    assert plan.blocks() == [B(70, NOW + 86_400.0)] * 4 + [None, None]


def test_no_duration_never_expires_and_zero_duration_expires_now():
    assert _plan([D(70, 0, 32)], prompt=32).blocks() == [B(70, None)] * 2
    assert _plan([D(70, 0, 32, duration=0.0)], prompt=32).blocks() == [B(70, NOW)] * 2


def test_a_range_ending_mid_block_leaves_that_block_untouched():
    assert _plan([D(70, 0, 70)], prompt=96).blocks() == [B(70)] * 4 + [None, None]


def test_a_block_straddling_two_ranges_gets_the_weaker():
    plan = _plan([D(80, 0, 100), D(40, 100, 200)], bs=64, prompt=256)
    assert plan.blocks() == [B(80), B(40), B(40), None]


def test_end_none_reaches_the_end_of_the_sequence_output_included():
    assert _plan([D(50, 16)], prompt=48, output=16).blocks() == [None] * 4  # untouched first block
    assert _plan([D(50)], prompt=48, output=16).blocks() == [B(50)] * 4


def test_covers_output_is_the_generated_tail():
    directives = [D(60, 0, 40), D(30, covers_output=True, duration=5.0)]
    at_admission = _plan(directives, prompt=40)
    assert at_admission.blocks() == [B(60), B(60)]
    done = _plan(directives, prompt=40, output=40)
    # block 2 holds prompt tokens 32..39 and output 40..47: the weaker of the two, expiry included
    assert done.blocks() == [B(60), B(60), B(30, NOW + 5.0), B(30, NOW + 5.0), B(30, NOW + 5.0)]


def test_overlapping_ranges_take_the_strongest_per_token():
    plan = _plan([D(50, 0, 64), D(90, 0, 32, duration=10.0)], prompt=64)
    # tokens 0..31 at (90, +10); 32..63 at (50, never), clamped to expire with their prefix
    assert plan.blocks() == [B(90, NOW + 10.0)] * 2 + [B(50, NOW + 10.0)] * 2


def test_priority_equal_strongest_is_the_later_expiry():
    plan = _plan([D(50, 0, 32, duration=10.0), D(50, 0, 32, duration=20.0), D(50, 0, 32, duration=5.0)], prompt=32)
    assert plan.blocks() == [B(50, NOW + 20.0)] * 2


def test_prefix_rule_clamps_priority_and_expiry():
    # two actions may together increase along the tokens; the clamp holds the prefix rule
    plan = _plan([D(30, 0, 32, duration=100.0), D(80, 32, 64), D(90, 64, 96, duration=500.0)], prompt=96)
    assert plan.blocks() == [B(30, NOW + 100.0)] * 6


def test_protection_after_an_untouched_block_is_dropped():
    assert _plan([D(50, 32, 64)], prompt=64).blocks() == [None, None, None, None]
    assert _plan([D(90, 0, 16), D(50, 32, 64)], prompt=64).blocks() == [B(90), None, None, None]


def test_priority_zero_releases_and_everything_after_it():
    plan = _plan([D(80, 0, 32), D(0, 32, 64, duration=9.0), D(50, 64, 96)], prompt=96)
    assert plan.blocks() == [B(80)] * 2 + [B(0)] * 4
    assert all(b.released and b.expiry is None for b in plan.blocks()[2:])


def test_a_release_after_untouched_blocks_stays_a_release():
    plan = _plan([D(0, 32, 64)], prompt=80)
    assert plan.blocks() == [None, None, B(0), B(0), None]


def test_ranges_past_the_sequence_or_empty_plans():
    assert _plan([D(50, 1000, 2000)], prompt=64).blocks() == [None] * 4
    assert _plan([D(50)], prompt=15).num_blocks == 0
    assert _plan([], prompt=64).blocks() == [None] * 4


def test_num_blocks_overrides_and_assign_skips_untouched_blocks():
    plan = _plan([D(70, 0, 48), D(0, 48, 64)], prompt=64, num_blocks=3)
    assert plan.blocks() == [B(70), B(70), B(70)]
    keys = [b"k0", b"k1", b"k2", b"k3"]
    assert plan.assign(keys) == [(b"k0", B(70)), (b"k1", B(70)), (b"k2", B(70))]
    plan = _plan([D(70, 16, 48), D(0, 48, 64)], prompt=64)  # protection after untouched block 0 is dropped
    assert plan.assign(keys) == [(b"k3", B(0))]
    assert plan.assign(keys[:3]) == []


def test_at_matches_blocks_and_is_none_out_of_range():
    plan = _plan([D(80, 0, 100), D(40, 100, 200), D(0, 200, 260)], bs=16, prompt=300)
    blocks = plan.blocks()
    assert [plan.at(i) for i in range(plan.num_blocks)] == blocks
    assert plan.at(-1) is None and plan.at(plan.num_blocks) is None


def test_a_million_blocks_plan_as_a_few_ranges():
    directives = [D(100 - i // 2, 126_000 * i, 126_000 * (i + 1), duration=60.0 * (128 - i)) for i in range(127)]
    directives.append(D(1, covers_output=True))
    plan = _plan(directives, prompt=16 * 1_000_000 - 8, output=8)
    assert plan.num_blocks == 1_000_000
    assert len(plan.ranges) <= 2 * len(directives) + 1
    assert plan.at(0) == B(100, NOW + 60.0 * 128)
    assert plan.at(999_999) == B(37, NOW + 60.0 * 2)


@pytest.mark.parametrize("bad", [dict(bs=0, prompt=10), dict(bs=16, prompt=-1), dict(bs=16, prompt=10, output=-2)])
def test_caller_errors_raise(bad):
    with pytest.raises(ValueError):
        _plan([], **bad)


# -- brute-force reference ------------------------------------------------------------------------

def _reference(directives, bs, prompt, output, now):
    total = prompt + output
    n = total // bs

    def key(lv):
        return (lv.priority, math.inf if lv.expiry is None else lv.expiry)

    tokens = [None] * (n * bs)
    for d in directives:
        a, b = (prompt, total) if d.covers_output else (d.start, total if d.end is None else d.end)
        lv = B(0) if d.priority == 0 else B(d.priority, None if d.duration is None else now + d.duration)
        for t in range(max(0, a), min(b, n * bs)):
            if tokens[t] is None or key(lv) > key(tokens[t]):
                tokens[t] = lv

    def weaker(x, y):
        p = min(x.priority, y.priority)
        if p == 0:
            return B(0)
        ex = min(key(x)[1], key(y)[1])
        return B(p, None if ex == math.inf else ex)

    out, cap = [], B(101)
    for i in range(n):
        piece = tokens[i * bs:(i + 1) * bs]
        lv = None if any(t is None for t in piece) else piece[0]
        for t in piece[1:] if lv is not None else ():
            lv = weaker(lv, t)
        if lv is None or lv.released:
            cap = lv
        elif cap is None:
            lv = None
        else:
            lv = cap = weaker(lv, cap)
        out.append(lv)
    return out


def _random_directive(rng, span):
    priority = rng.choice([0, 1, 10, 50, 50, 90, 100])
    duration = rng.choice([None, 0.0, 5.0, 60.0, 3600.0])
    if rng.random() < 0.15:
        return D(priority, duration=duration, covers_output=True)
    start = rng.randrange(0, span)
    end = rng.choice([None, start + rng.randrange(1, span)])
    return D(priority, start, end, duration)


@pytest.mark.parametrize("seed", range(300))
def test_matches_per_token_reference(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 3, 16])
    prompt, output = rng.randrange(0, 120), rng.randrange(0, 40)
    directives = [_random_directive(rng, 150) for _ in range(rng.randrange(0, 7))]
    got = _plan(directives, bs=bs, prompt=prompt, output=output)
    assert got.blocks() == _reference(directives, bs, prompt, output, NOW)
