"""Pacing of a restore's verify+scatter against the engine's steps (``pacing.StepShare``) and its
use by ``TieredStore.load``: slices, grants, debt, stalls, deadlines, and the same bytes restored."""

from __future__ import annotations

import threading
import time

import pytest

import dynamo_tiered_kv.store.reads.pipeline as sr
from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.policy.pacing import StepShare
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.tiers.host import HostTier
from tests.test_store import REC, NamedHost, block_bytes, keys_for, make_layout, make_store


def _admit_in_thread(p: StepShare, deadline: float | None = None) -> tuple[threading.Thread, list[float]]:
    done: list[float] = []
    t = threading.Thread(target=lambda: (p.admit(deadline), done.append(time.monotonic())))
    t.start()
    return t, done


def _blocked_until_an_idle_step(p: StepShare) -> None:
    t, done = _admit_in_thread(p)
    time.sleep(0.1)
    assert not done
    p.step(busy=False)
    t.join(2)
    assert done


def stored(tier, n: int, seed: int, **kw):
    """A store over ``tier`` holding ``n`` blocks of a seeded layout: (store, pool, src, keys)."""
    pool = StagingPool(16 * REC, 6, pin=False)
    src, keys = make_layout(64, seed=seed), keys_for(n)
    store = make_store([tier], pool, **kw)
    store.submit_offload(src, list(range(1, n + 1)), keys, parents_of(keys))
    assert store.drain(10)
    return store, pool, src, keys


def test_idle_engine_never_limits() -> None:
    p = StepShare(0.1, stall_s=5.0)
    p.admit(None)  # before any step: nothing to protect
    p.step(busy=True)
    p.spent(1.0)  # far over the grant
    p.step(busy=False)  # an idle step frees it
    t0 = time.monotonic()
    p.admit(None)
    p.spent(1.0)
    p.admit(None)
    assert time.monotonic() - t0 < 0.5


def test_busy_steps_grant_a_share_of_the_step_and_debt_carries() -> None:
    p = StepShare(0.5, stall_s=5.0, first_step_s=0.004)
    p.step(busy=True)  # grant 0.5 * 4 ms = 2 ms
    p.admit(None)
    p.spent(0.005)  # overran by 3 ms: debt
    t, done = _admit_in_thread(p)
    time.sleep(0.1)
    assert not done  # no credit until the next busy step
    time.sleep(0.1)
    p.step(busy=True)  # ~200 ms step: -3 ms + 100 ms
    t.join(2)
    assert done and p.waited_s >= 0.15
    p.spent(0.05)  # 47 ms left: admitted at once
    t0 = time.monotonic()
    p.admit(None)
    assert time.monotonic() - t0 < 0.05
    p.spent(0.2)  # -153 ms: a ~20 ms step (10 ms grant) does not pay that off
    time.sleep(0.02)
    p.step(busy=True)
    _blocked_until_an_idle_step(p)


def test_unused_grant_is_not_saved_up() -> None:
    p = StepShare(0.5, stall_s=5.0, first_step_s=0.002)
    p.step(busy=True)
    time.sleep(0.2)
    p.step(busy=True)  # grant 100 ms
    p.step(busy=True)  # a short step right after: replaces the unused 100 ms with ~0
    p.spent(0.01)
    _blocked_until_an_idle_step(p)


def test_a_stalled_engine_or_the_deadline_lets_the_slice_run() -> None:
    p = StepShare(0.2, stall_s=0.15, first_step_s=0.001)
    p.step(busy=True)
    p.spent(1.0)
    t0 = time.monotonic()
    p.admit(None)  # no step for stall_s: runs anyway
    assert 0.12 <= time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    p.admit(t0 + 0.03)  # deadline before the stall timeout
    assert time.monotonic() - t0 < 0.12
    t0 = time.monotonic()
    p.admit(t0 - 1)  # already past
    assert time.monotonic() - t0 < 0.05


def test_share_must_be_a_fraction() -> None:
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError):
            StepShare(bad)


class RecordingPacer:
    """Admits every slice at once and counts them; ``limiting`` as given."""

    def __init__(self, limiting: bool = True) -> None:
        self.admits = 0
        self.spent_calls = 0
        self.deadlines: list[float | None] = []
        self._limiting = limiting

    def admit(self, deadline: float | None) -> None:
        self.admits += 1
        self.deadlines.append(deadline)

    def spent(self, seconds: float) -> None:
        assert seconds >= 0
        self.spent_calls += 1

    def limiting(self) -> bool:
        return self._limiting


@pytest.mark.parametrize("tier_kind", ["host", "ssd"])
def test_paced_load_restores_the_same_bytes_in_slices(tier_kind: str, monkeypatch) -> None:
    monkeypatch.setattr(sr, "SLICE_BYTES", 3 * REC)
    tier = HostTier(64 * REC, chunk_bytes=REC, pin=False) if tier_kind == "host" else NamedHost("ssd", 64 * REC)
    store, pool, src, keys = stored(tier, 20, 5)
    with store:
        pacer = RecordingPacer()
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 50)), keys, timeout=10, pacer=pacer)
        assert res.loaded_block_ids == list(range(30, 50)) and not res.failed_block_ids
        for s, d in zip(range(1, 21), range(30, 50), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        # 3 records per slice: at least ceil(20 / 3) slices, each admitted and accounted
        assert pacer.admits >= 7 and pacer.spent_calls == pacer.admits
        assert all(d is not None for d in pacer.deadlines)  # the load's deadline reaches the pacer
    pool.close()


def test_paced_load_still_stops_at_a_corrupt_record(monkeypatch) -> None:
    monkeypatch.setattr(sr, "SLICE_BYTES", 2 * REC)
    ssd = NamedHost("ssd", 64 * REC)
    store, pool, _, keys = stored(ssd, 10, 9)
    with store:
        _, chunks = ssd._index[keys[5]]
        ssd._chunks[chunks[0], REC - 100] ^= 0xFF  # flip a payload byte of record 5
        res = store.load(make_layout(64), list(range(30, 40)), keys, timeout=10, pacer=RecordingPacer())
        assert res.loaded_block_ids == list(range(30, 35)) and res.failed_block_ids == list(range(35, 40))
        assert store.metrics.value("checksum_failures_total", tier="ssd") == 1
        store.drain(10)
        assert not ssd.contains(keys[5])  # the bad record was forgotten
    pool.close()


def test_paced_load_waits_for_engine_steps_but_ends_by_its_deadline(monkeypatch) -> None:
    monkeypatch.setattr(sr, "SLICE_BYTES", REC)
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    store, pool, _, keys = stored(host, 8, 4)
    with store:
        pacer = StepShare(0.01, stall_s=0.05, first_step_s=0.001)
        pacer.step(busy=True)
        pacer.spent(10.0)  # deep in debt and no further step: every slice waits for stall_s
        t0 = time.monotonic()
        res = store.load(make_layout(64), list(range(30, 38)), keys, timeout=10, pacer=pacer)
        took = time.monotonic() - t0
        assert res.loaded_block_ids == list(range(30, 38))  # paced, not failed
        assert took >= 8 * 0.04 and pacer.waited_s >= 8 * 0.04
        st = res.stages
        assert st.paced_s >= 8 * 0.04 and 0 <= st.decode_s < st.paced_s  # held back, not decoding
        assert store.metrics.value("restore_stage_seconds_count", stage="paced", tier="all") == 1
    pool.close()


@pytest.mark.parametrize("limiting", [True, False])
def test_a_limiting_pacer_reads_only_the_next_chunk_ahead(limiting: bool, monkeypatch) -> None:
    from tests.test_store_pipeline import PieceTier

    monkeypatch.setattr(sr, "MIN_PIECE_BYTES", 1 << 40)  # one read per chunk: reads in flight = chunks
    ssd = PieceTier("ssd", 64 * REC)
    store, pool, _, keys = stored(ssd, 24, 6, load_chunk_bytes=3 * REC, load_first_chunk_bytes=3 * REC)
    with store:
        res = store.load(make_layout(64), list(range(30, 54)), keys, timeout=10,
                         pacer=RecordingPacer(limiting))
        assert res.loaded_block_ids == list(range(30, 54))
        if limiting:
            assert ssd.max_in_flight <= 2
        else:
            assert ssd.max_in_flight >= 3  # the store's usual read-ahead
    pool.close()


@pytest.mark.parametrize("limiting", [True, False])
def test_a_limiting_pacer_reads_in_the_tiers_frugal_pieces(limiting: bool) -> None:
    from tests.test_store_pipeline import PieceTier

    ssd = PieceTier("ssd", 64 * REC)
    ssd.read_piece_bytes = REC  # type: ignore[attr-defined]
    ssd.frugal_piece_bytes = 4 * REC  # type: ignore[attr-defined]
    store, pool, src, keys = stored(ssd, 24, 8, load_chunk_bytes=8 * REC, load_first_chunk_bytes=8 * REC)
    with store:
        ssd.calls.clear()
        dst = make_layout(64)
        res = store.load(dst, list(range(30, 54)), keys, timeout=10, pacer=RecordingPacer(limiting))
        assert res.loaded_block_ids == list(range(30, 54))
        for s, d in zip(range(1, 25), range(30, 54), strict=True):
            assert block_bytes(src, s) == block_bytes(dst, d)
        assert sum(ssd.calls) == 24
        # chunks of 8 records: 2 pieces of 4 while limited, else the tier's 4-way parallel pieces of 2
        assert sorted(set(ssd.calls)) == ([4] if limiting else [2])
    pool.close()
