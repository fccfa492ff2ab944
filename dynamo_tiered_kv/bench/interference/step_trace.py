"""Per-step CPU accounting for engine benches: each engine step's wall time, and how much CPU
every thread of the process used during it.

On a CPU engine the forward and a restore share the cores, so "which step was slow" is only
half an answer; the other half is who ran during it. Each thread's on-CPU nanoseconds come from
``/proc/self/task/<tid>/schedstat``, read before and after the step. Threads are grouped by
their Python name without a trailing number (``dtkv-onboard_3`` -> ``dtkv-onboard``); threads
Python does not know (OpenMP workers, NIXL's) are ``native``. A thread that exits during a step
is not counted (its ``/proc`` entry is gone): the engine's and the store's threads live in pools.
Linux only; elsewhere every step reports an empty CPU map.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from typing import Any

from ..report import percentile

_TASKS = "/proc/self/task"
_NUMBERED = re.compile(r"[_-]?\d+$")
MIN_CPU_MS = 0.05  # below this a thread's share of a step is not recorded


def thread_cpu_ns() -> dict[int, int]:
    """On-CPU nanoseconds of every thread of this process, by native thread id."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return out


def thread_group(name: str) -> str:
    return _NUMBERED.sub("", name) or name


class StepTrace:
    """``begin()`` before an engine step, ``end(phase, restoring)`` after it; ``steps`` holds one
    dict per step: phase, step_ms, restoring (restores in flight), cpu_ms per thread group."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._cpu0: dict[int, int] = {}
        self._t0 = 0.0

    def begin(self) -> None:
        self._cpu0 = thread_cpu_ns()
        self._t0 = time.perf_counter()

    def end(self, phase: str, restoring: int) -> None:
        wall = time.perf_counter() - self._t0
        cpu1 = thread_cpu_ns()
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        groups: dict[str, float] = {}
        for tid, ns in cpu1.items():
            ms = (ns - self._cpu0.get(tid, 0)) / 1e6
            if ms >= MIN_CPU_MS:
                g = thread_group(names[tid]) if tid in names else "native"
                groups[g] = round(groups.get(g, 0.0) + ms, 3)
        self.steps.append({"phase": phase, "step_ms": round(wall * 1e3, 3), "restoring": restoring,
                           "cpu_ms": groups})


def summarize(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase kind (``r0-restore`` and ``r1-restore`` are ``restore``): steps, wall ms, step
    p50/p99/max ms, steps with a restore in flight and their p50, CPU ms per thread group."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for s in steps:
        kinds.setdefault(s["phase"].split("-", 1)[-1], []).append(s)
    rows = []
    for kind, ss in kinds.items():
        dts = [s["step_ms"] for s in ss]
        during = [s["step_ms"] for s in ss if s["restoring"]]
        cpu: dict[str, float] = {}
        for s in ss:
            for g, ms in s["cpu_ms"].items():
                cpu[g] = cpu.get(g, 0.0) + ms
        rows.append({"phase": kind, "steps": len(ss), "wall_ms": sum(dts), "step_p50_ms": statistics.median(dts),
                     "step_p99_ms": percentile(dts, 0.99), "step_max_ms": max(dts), "restoring_steps": len(during),
                     "restoring_step_p50_ms": statistics.median(during) if during else None,
                     "cpu_ms": dict(sorted(cpu.items(), key=lambda kv: -kv[1]))})
    return rows


def format_rows(session: str, rows: list[dict[str, Any]], groups: list[str]) -> list[str]:
    """Table lines: one per phase, CPU ms of ``groups`` (the rest summed as ``other``)."""
    out = []
    for r in rows:
        cpu = r["cpu_ms"]
        rest = sum(v for g, v in cpu.items() if g not in groups)
        during = r["restoring_step_p50_ms"]
        out.append(f"{session:<16} {r['phase']:<9} {r['steps']:>5} {r['wall_ms']:>8.0f} {r['step_p50_ms']:>6.1f} "
                   f"{r['step_p99_ms']:>6.1f} {'-' if during is None else f'{during:.1f}':>7} "
                   + " ".join(f"{cpu.get(g, 0.0):>12.0f}" for g in groups) + f" {rest:>8.0f}")
    return out
