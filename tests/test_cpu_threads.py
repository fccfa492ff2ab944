"""How many threads a synchronous restore on a CPU engine's thread verifies+scatters with."""

from __future__ import annotations

import os

import pytest

from dynamo_tiered_kv.connectors.vllm.cpu_threads import engine_sync_decode_threads, sync_decode_threads


@pytest.mark.parametrize(("omp", "cpus", "env", "want"), [
    (2, 2, {}, 1),  # the team owns every core and spins after a forward: stay on the engine's thread
    (8, 8, {"OMP_WAIT_POLICY": "active"}, 1),
    (1, 2, {}, 2),  # one core left free
    (4, 8, {}, 5),  # four free cores beside the caller's
    (2, 2, {"OMP_WAIT_POLICY": "PASSIVE"}, 2),  # the workers sleep at once
    (2, 2, {"OMP_WAIT_POLICY": " passive "}, 2),
    (4, 4, {"KMP_BLOCKTIME": "0"}, 4),  # Intel OpenMP without a spin
    (4, 4, {"KMP_BLOCKTIME": "5"}, 1),
    (16, 4, {}, 1),  # more workers than CPUs
    (0, 1, {}, 1),
])
def test_rule(omp: int, cpus: int, env: dict[str, str], want: int) -> None:
    assert sync_decode_threads(omp, cpus, env) == want


def test_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert engine_sync_decode_threads() == cpus
        torch.set_num_threads(cpus)
        assert engine_sync_decode_threads() == 1
        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
        assert engine_sync_decode_threads() == cpus
    finally:
        torch.set_num_threads(before)
