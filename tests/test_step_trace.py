"""bench step trace: a step's wall time and each thread's CPU during it, grouped by thread name."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from dynamo_tiered_kv.bench.interference import step_trace
from dynamo_tiered_kv.bench.interference.step_trace import StepTrace, thread_group

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/task/*/schedstat")


def _burn(seconds: float, done: threading.Event, release: threading.Event) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    done.set()
    release.wait(10)  # alive until the step ends: an exited thread's CPU is gone from /proc


def test_thread_groups_drop_trailing_numbers() -> None:
    assert thread_group("dtkv-onboard_3") == "dtkv-onboard"
    assert thread_group("asyncio_12") == "asyncio" and thread_group("dtkv-ssd0") == "dtkv-ssd"
    assert thread_group("MainThread") == "MainThread"


@linux_only
def test_a_busy_thread_is_charged_to_the_step_it_ran_in() -> None:
    trace = StepTrace()
    trace.begin()
    done, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_burn, args=(0.08, done, release), name="burner_1")
    t.start()
    assert done.wait(10)
    trace.end("r0-restore", restoring=1)
    release.set()
    t.join()
    trace.begin()
    time.sleep(0.02)  # nobody burns: the idle step charges (almost) nothing
    trace.end("r0-baseline", restoring=0)
    busy, idle = trace.steps
    assert busy["cpu_ms"]["burner"] >= 60 and busy["step_ms"] >= 80 and busy["restoring"] == 1
    assert "burner" not in idle["cpu_ms"] and idle["step_ms"] >= 20
    assert idle["cpu_ms"].get("MainThread", 0.0) < 10  # asleep (other tests' threads may still run)


def test_summary_and_table_per_phase_kind() -> None:
    steps = [{"phase": f"r{r}-restore", "step_ms": ms, "restoring": int(ms > 20),
              "cpu_ms": {"MainThread": ms, "native": ms, **({"dtkv-onboard": 30.0} if ms > 20 else {}),
                         "tqdm": 1.0}}
             for r in range(2) for ms in (8.0, 8.0, 40.0)]
    steps.append({"phase": "r0-baseline", "step_ms": 8.0, "restoring": 0, "cpu_ms": {"MainThread": 8.0}})
    rows = {r["phase"]: r for r in step_trace.summarize(steps)}
    restore = rows["restore"]
    assert restore["steps"] == 6 and restore["restoring_steps"] == 2 and restore["restoring_step_p50_ms"] == 40.0
    assert restore["step_p50_ms"] == 8.0 and restore["step_max_ms"] == 40.0
    assert restore["cpu_ms"]["dtkv-onboard"] == 60.0 and rows["baseline"]["restoring_step_p50_ms"] is None
    lines = step_trace.format_rows("ssd", list(rows.values()), ["MainThread", "dtkv-onboard"])
    assert len(lines) == 2 and lines[0].split()[:3] == ["ssd", "restore", "6"]
    assert lines[0].split()[-3:] == ["112", "60", "118"]  # MainThread, onboard, other (native 112 + tqdm 6)
