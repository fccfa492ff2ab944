import threading

import pytest
import torch

from dynamo_tiered_kv.errors import StagingExhausted
from dynamo_tiered_kv.staging.slabs import PAGE, StagingPool


def test_slabs_are_page_aligned_and_reused() -> None:
    pool = StagingPool(100_000, 3, pin=False)
    try:
        assert pool.slab_bytes % PAGE == 0 and pool.slab_bytes >= 100_000
        addrs = {s.address for s in pool.slabs}
        assert len(addrs) == 3 and all(a % PAGE == 0 for a in addrs)
        seen = set()
        for _ in range(10):
            with pool.slab() as s:
                s.array[:4] = 7
                assert s.tensor.data_ptr() == s.address  # the three views alias one buffer
                assert bytes(s.view[:4]) == b"\x07" * 4
                seen.add(s.address)
        assert seen <= addrs
        assert pool.free_count == 3
    finally:
        pool.close()


def test_exhaustion_times_out_and_release_wakes_waiters() -> None:
    pool = StagingPool(PAGE, 1, pin=False)
    try:
        s = pool.acquire()
        assert pool.try_acquire(0) is None
        with pytest.raises(StagingExhausted):
            pool.acquire(timeout=0.01)
        got = []
        t = threading.Thread(target=lambda: got.append(pool.acquire(timeout=5)))
        t.start()
        pool.release(s)
        t.join()
        assert got == [s]
        with pytest.raises(ValueError, match="twice"):
            pool.release(s)
            pool.release(s)
    finally:
        pool.close()


def test_no_pinning_without_cuda() -> None:
    pool = StagingPool(PAGE, 1)
    try:
        assert pool.pinned is torch.cuda.is_available()
    finally:
        pool.close()


@pytest.mark.gpu
def test_pinned_slabs_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool = StagingPool(1 << 20, 2)
    try:
        assert pool.pinned
        s = pool.acquire()
        s.tensor.fill_(3)
        g = s.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(g.sum()) == 3 * (1 << 20)
        assert s.tensor.is_pinned()
        pool.release(s)
    finally:
        pool.close()
