"""The scheduler role sends hint counters only when they changed: every count reaches the workers
exactly once, and a step with nothing new takes no copy of the tallies."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from test_connector_scheduler import BS, FakeLookup, FakeRequest, sched_output

from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm import scheduler as scheduler_mod
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.hints import RETAIN_ACTION, HintStats
from dynamo_tiered_kv.hints.stats import HintCounts


@dataclass
class _HintedRequest(FakeRequest):
    kv_transfer_params: dict = field(default_factory=dict)


class _CountingStats(HintStats):
    """Counts ``counts()`` calls; ``late`` makes one more count right after the copy is taken, as
    another thread counting between the scheduler's look at ``changes`` and its next step would."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.late = False

    def counts(self) -> HintCounts:
        self.copies += 1
        out = super().counts()
        if self.late:
            self.late = False
            self.envelope("late")
        return out


def _role(monkeypatch: pytest.MonkeyPatch) -> tuple[SchedulerRole, _CountingStats]:
    monkeypatch.setattr(scheduler_mod, "HintStats", _CountingStats)
    sched = SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=BS, lookup=FakeLookup(set()))
    assert isinstance(sched.hint_stats, _CountingStats)
    return sched, sched.hint_stats


def _sent(sched: SchedulerRole) -> HintCounts | None:
    return sched.build_connector_meta(sched_output({})).hint_counts


def _total(sent: list[HintCounts]) -> list:
    summed = HintStats()
    for c in sent:
        assert summed.add(c)
    return sorted(summed.counts().entries)


def test_counts_between_steps_arrive_once_and_idle_steps_take_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    sched, stats = _role(monkeypatch)
    assert _sent(sched) is None and stats.copies == 0  # nothing counted yet: no copy taken

    sched.get_num_new_matched_tokens(_HintedRequest("bad", list(range(3 * BS)),
                                                    kv_transfer_params={"kv_hints": "junk"}), 0)
    stats.rejected(RETAIN_ACTION, "directives")
    first = _sent(sched)
    assert first is not None and stats.copies == 1
    assert sorted(first.entries) == [("actions", (RETAIN_ACTION, "rejected"), 1),
                                     ("envelopes", ("malformed",), 1), ("rejections", (RETAIN_ACTION, "directives"), 1)]

    for _ in range(5):
        assert _sent(sched) is None  # idle steps: nothing attached, no copy
    assert stats.copies == 1

    stats.envelope("ok")
    stats.envelope("ok")
    second = _sent(sched)
    assert second is not None and sorted(second.entries) == [("envelopes", ("ok",), 2)]
    assert stats.copies == 2 and _sent(sched) is None and stats.copies == 2
    assert _total([first, second]) == sorted(stats.counts().entries)


def test_a_count_racing_with_the_copy_is_sent_with_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    sched, stats = _role(monkeypatch)
    stats.envelope("ok")
    stats.late = True  # one more count lands after the copy this step takes
    first = _sent(sched)
    assert first is not None and sorted(first.entries) == [("envelopes", ("ok",), 1)]
    second = _sent(sched)  # the late count moved ``changes``: this step looks again
    assert second is not None and sorted(second.entries) == [("envelopes", ("late",), 1)]
    assert _sent(sched) is None
    assert _total([first, second]) == sorted(stats.counts().entries)


def test_every_kind_of_count_moves_changes() -> None:
    stats = HintStats()
    counters = [lambda: stats.envelope("ok"), lambda: stats.action(RETAIN_ACTION, "accepted"),
                lambda: stats.rejected(RETAIN_ACTION, "directives"), lambda: stats.truncated_directives(2),
                lambda: stats.applied("kv.fetch", "left_to_peer"),
                lambda: stats.add(HintCounts((("envelopes", ("ok",), 1),)))]
    for count in counters:
        before = stats.changes
        count()
        assert stats.changes > before
    before = stats.changes
    stats.counts()
    assert not stats.add("junk") and stats.changes == before  # reads and refused adds change nothing
