"""vLLM sleep mode (0.33 ``unregister_kv_caches``/``restore_kv_caches``): restores end before the
KV memory goes, GPU-direct registrations are dropped for sleep and come back at wake-up."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import torch
from test_connector_async import _GatedStore, _spec, _worker

from dynamo_tiered_kv.staging.device_slabs import DeviceSpan, DeviceStagingPool
from dynamo_tiered_kv.testing import make_record, random_key, small_shape

SHAPE = small_shape(num_layers=2)


def test_sleep_waits_for_restores_writing_engine_memory_and_is_idempotent() -> None:
    from dynamo_tiered_kv.connectors.vllm.metadata import TieredKVMetadata

    store = _GatedStore()
    store.suspended = store.resumed = 0
    store.drain = lambda timeout=None: True

    def suspend_device(timeout: float = 30.0) -> bool:
        assert 1 in store.returned, "device memory released while a restore could still scatter into it"
        store.suspended += 1
        return True

    store.suspend_device = suspend_device
    store.resume_device = lambda: setattr(store, "resumed", store.resumed + 1)
    w = _worker(store)
    w.start_load_kv(TieredKVMetadata(loads=[_spec("r", [1, 2])]))
    time.sleep(0.05)
    threading.Timer(0.3, store.gate.set).start()
    t0 = time.monotonic()
    w.unregister_kv_caches()  # returns only once the restore's thread stopped writing
    assert time.monotonic() - t0 >= 0.25 and 1 in store.returned
    w.unregister_kv_caches()
    assert store.suspended == 1
    w.restore_kv_caches()
    w.restore_kv_caches()
    assert store.resumed == 1
    assert w.get_finished(set()) == {"r"}  # the finished restore is still reported after wake-up
    w.shutdown()


def test_connector_says_it_supports_sleep_mode() -> None:
    pytest.importorskip("vllm")
    from dynamo_tiered_kv.connectors.vllm.connector import TieredKVConnector

    assert TieredKVConnector.supports_sleep_mode(None) is True
    assert "unregister_kv_caches" in vars(TieredKVConnector) and "restore_kv_caches" in vars(TieredKVConnector)


def test_device_io_suspend_refuses_transfers_and_resume_restores_them(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    import os

    from dynamo_tiered_kv.tiers.ssd.gds import DeviceIO

    pool = DeviceStagingPool(1 << 20, 1, "cpu")  # CPU stand-in: host memory through NIXL POSIX
    dio = DeviceIO("POSIX")
    dio.register(pool.slabs)
    (slab,) = pool.slabs
    rec = make_record(random_key(1, b"sleep"), 1, shape=SHAPE)
    n = len(rec)
    slab.tensor[:n].copy_(torch.frombuffer(bytearray(rec), dtype=torch.uint8))
    path = tmp_path / "f"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip("this filesystem refuses O_DIRECT")
        raise
    try:
        dio.write(fd, [DeviceSpan(slab, 0, n)], 0)
        dio.suspend()
        with pytest.raises((OSError, ValueError)):
            dio.read(fd, [DeviceSpan(slab, n, n)], 0)
        dio.resume()
        dio.read(fd, [DeviceSpan(slab, n, n)], 0)
        assert bytes(slab.tensor[n:2 * n].numpy()) == rec
    finally:
        dio.forget(fd)
        os.close(fd)
        dio.close()
        pool.close()


def test_device_staging_is_allocated_outside_the_engine_threads_memory_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM builds the store (``register_kv_caches``) inside ``CuMemAllocator.use_memory_pool``, which
    like ``torch.cuda.use_mem_pool`` routes the calling thread's allocations only. A fake pool with
    that per-thread rule stands in for it: the staging slabs must not come out of it."""
    from dynamo_tiered_kv.staging import device_slabs as device_staging

    pool = threading.local()  # pool.active: this thread's allocations go to the sleep-mode pool
    allocations: list[bool] = []

    def fake_cuda_empty(nbytes: int, device: torch.device) -> torch.Tensor:
        allocations.append(getattr(pool, "active", False))
        return torch.empty(nbytes, dtype=torch.uint8)  # host memory standing in for VRAM

    monkeypatch.setattr(device_staging, "_device_empty", fake_cuda_empty)
    pool.active = True  # the engine thread, inside the pool context
    try:
        staging = DeviceStagingPool(1 << 20, 2, "cuda:0")
    finally:
        pool.active = False
    assert allocations == [False, False]  # both slabs from the default allocator
    assert all(s.mem_type == "VRAM" and s.tensor.numel() == 1 << 20 for s in staging.slabs)


def test_device_staging_allocation_errors_reach_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv.staging import device_slabs as device_staging

    def oom(nbytes: int, device: torch.device) -> torch.Tensor:
        raise torch.OutOfMemoryError("fake")

    monkeypatch.setattr(device_staging, "_device_empty", oom)
    with pytest.raises(torch.OutOfMemoryError):
        DeviceStagingPool(1 << 20, 1, "cuda:0")
