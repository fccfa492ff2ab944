"""``dtkv demo``'s verdict, without an engine: output comparison and the summary line."""

from __future__ import annotations

from dynamo_tiered_kv.commands.demo import TIE_NATS, compare, summary


def test_same_token_is_same() -> None:
    r = compare((5, {5: -1.0, 6: -2.0}), (5, {5: -1.01, 6: -2.0}))
    assert r["verdict"] == "same" and r["same_output"] and abs(r["logprob_gap"] - 0.01) < 1e-9


def test_near_tie_is_noise_not_a_mismatch() -> None:
    eps = TIE_NATS / 4
    r = compare((6, {5: -1.0 - eps, 6: -1.0}), (5, {5: -1.0, 6: -1.0 - eps}))
    assert r["verdict"] == "near-tie" and r["same_output"]


def test_clear_winner_changed_is_different() -> None:
    r = compare((6, {6: -0.5, 5: -2.0}), (5, {5: -0.5, 6: -2.0}))
    assert r["verdict"] == "DIFFERENT" and not r["same_output"]
    # a token the reference did not even rank
    assert compare((9, {9: -0.1}), (5, {5: -0.5, 6: -2.0}))["verdict"] == "DIFFERENT"


def _turn(restored: int, rec: float | None, res: float, verdict: str = "same") -> dict:
    return {"restored_tokens": restored, "ttft_recompute_ms": rec, "ttft_restore_ms": res, "verdict": verdict,
            "same_output": verdict != "DIFFERENT"}


def test_summary_counts_restored_turns_and_speedup_per_tier() -> None:
    sessions = {
        "live": {"turns": [_turn(0, 170, 100), _turn(2048, 400, 100), _turn(4096, 600, 100, "near-tie")]},
        "restart": {"turns": [_turn(2048, 400, 200), _turn(4096, 600, 200)]},
    }
    line = summary(sessions)
    assert line.startswith("dtkv demo OK: 4/5 turns restored, 4/4 restored outputs match")
    assert "(1 within bf16 noise)" in line
    assert "host 4.0-6.0x" in line and "ssd 2.0-3.0x" in line  # turn 1 (nothing restored) is not a speedup


def test_summary_flags_mismatch() -> None:
    line = summary({"restart": {"turns": [_turn(2048, 400, 200, "DIFFERENT")]}})
    assert line.startswith("dtkv demo MISMATCH: 1/1 turns restored, 0/1") and "ssd 2.0x" in line
