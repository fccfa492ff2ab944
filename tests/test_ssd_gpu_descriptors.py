"""GPU-direct transfers (``tiers/ssd/gds.py``): descriptors are cut at a few MiB so GDS_MT can spread
one transfer over its threads, and the agent lock is held only around NIXL calls, never across the
wait for a transfer (another thread's registration or read is not queued behind it)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from dynamo_tiered_kv.staging.device_slabs import DeviceSpan, DeviceStagingPool
from dynamo_tiered_kv.tiers.ssd.gds import MAX_DESC_BYTES, DeviceIO, _merge


def test_runs_are_joined_then_cut_at_the_descriptor_cap() -> None:
    pool = DeviceStagingPool(3 * MAX_DESC_BYTES, 2, "cpu")
    try:
        a, b = pool.slabs
        half = MAX_DESC_BYTES // 2
        spans = [DeviceSpan(a, 0, half), DeviceSpan(a, half, 2 * MAX_DESC_BYTES), DeviceSpan(b, 0, 4096)]
        runs = _merge(spans)
        assert [n for _, n, _ in runs] == [MAX_DESC_BYTES, MAX_DESC_BYTES, half, 4096]
        assert [addr for addr, _, _ in runs[:3]] == [a.address + i * MAX_DESC_BYTES for i in range(3)]
        assert sum(n for _, n, _ in runs) == sum(s.nbytes for s in spans)
    finally:
        pool.close()


def test_the_lock_is_free_while_a_transfer_is_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv.tiers.ssd import io

    monkeypatch.setattr(io, "NIXL_TIMEOUT_S", 10.0)  # a lock held across the wait ends in a timeout, not a hang
    pool = DeviceStagingPool(1 << 16, 1, "cpu")
    dio = DeviceIO("POSIX")
    dio.register(pool.slabs)
    real = dio._ag
    other_thread_got_in, in_flight = threading.Event(), threading.Event()

    class SlowAgent:  # the transfer stays in flight until another thread has used the DeviceIO
        def __getattr__(self, name: str):
            return getattr(real, name)

        def transfer(self, h):
            in_flight.set()
            return "PROC"

        def check_xfer_state(self, h):
            return "DONE" if other_thread_got_in.is_set() else "PROC"

    dio._ag = SlowAgent()  # type: ignore[assignment]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            dio.write(fd, [DeviceSpan(pool.slabs[0], 0, 4096)], 0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    try:
        assert in_flight.wait(30)
        dio.forget(12345)  # needs the lock: blocks for good if the writer held it across its wait
        other_thread_got_in.set()
        t.join(30)
        assert not t.is_alive() and not errors
    finally:
        other_thread_got_in.set()
        t.join(30)
        dio._ag = real
        dio.forget(fd)
        os.close(fd)
        dio.close()
        pool.close()
