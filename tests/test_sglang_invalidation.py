"""Stored SGLang pages are invalidated by what SGLang does on a weight update, on every rank alike.

SGLang 0.5.23's weight update (``update_weights_from_disk/tensor/distributed/ipc``) records the new
weight version, then flushes: ``Scheduler.flush_cache`` -> ``tree_cache.reset()`` ->
``UnifiedRadixCache._reset_full`` -> ``cache_controller.reset()`` (storage threads joined) ->
``mem_pool_host.clear()``. The storage backend's ``clear()`` is never called on that path.
"""

from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="sglang 0.5.23 not installed (bash .ci/install-sglang.sh)")
from dynamo_tiered_kv.connectors.sglang.epoch import KeyEpoch, launch_token
from dynamo_tiered_kv.testing import sglang_host as sh

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 16, 4
SMALL = {"staging_slab_bytes": 1 << 20, "staging_slabs": 4}


@pytest.fixture(scope="module")
def sgl() -> sh.Sglang:
    return sh.load_sglang()


def make(sgl: sh.Sglang, **cfg: Any) -> tuple[Any, Any]:
    pool = sh.mha_host_pool(sgl, "page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                            pages=16)
    conf = sh.storage_config(sgl, sh.backend_extra(**SMALL, host_capacity_bytes=4 << 20, **cfg))
    return sh.attach(sgl, conf, pool), pool


def test_sglang_weight_update_path_ends_in_the_host_pool_clear(sgl: sh.Sglang) -> None:
    """The SGLang code the hook relies on: if this chain changes, the hook must move with it."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    for name in ("update_weights_from_disk", "update_weights_from_distributed", "update_weights_from_tensor"):
        assert "flush_cache_after_weight_update(" in inspect.getsource(getattr(SchedulerWeightUpdaterManager, name))
    assert "self.flush_cache(" in inspect.getsource(SchedulerWeightUpdaterManager.flush_cache_after_weight_update)
    assert "self.tree_cache.reset()" in inspect.getsource(Scheduler.flush_cache)
    assert "self._reset_full()" in inspect.getsource(UnifiedRadixCache.reset)
    reset = inspect.getsource(UnifiedRadixCache._reset_full)
    assert "self.cache_controller.mem_pool_host.clear()" in reset and "clear_storage_backend" not in reset


def test_weight_update_flush_makes_stored_pages_unreachable(sgl: sh.Sglang) -> None:
    """What a weight update does at the backend's boundary: SGLang records the new weight version in
    its runtime context, then its flush clears the host pool the backend registered."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    with rc.use_context(rc.create_context(ServerArgs(model_path="dummy"), role="scheduler")):
        backend, pool = make(sgl)
        try:
            hashes = sh.page_hashes(sgl, list(range(3 * PAGE)), PAGE)
            backend.batch_set_v1(hashes, pool.alloc(3 * PAGE))
            backend.store.persist(30)
            assert backend.batch_exists(hashes) == 3
            rc.get_context().override("scheduler.weight_version", weight_version="v2")
            pool.clear()  # UnifiedRadixCache._reset_full
            assert backend.batch_exists(hashes) == 0
            assert backend.batch_get_v1(hashes, pool.alloc(3 * PAGE)) == [False] * 3
            backend.batch_set_v1(hashes, pool.alloc(3 * PAGE))  # the new weights' pages are stored again
            backend.store.persist(30)
            assert backend.batch_exists(hashes) == 3
        finally:
            backend.close()


def test_keep_ignores_the_flush(sgl: sh.Sglang) -> None:
    backend, pool = make(sgl, cache_reset="keep")
    try:
        hashes = sh.page_hashes(sgl, list(range(2 * PAGE)), PAGE)
        backend.batch_set_v1(hashes, pool.alloc(2 * PAGE))
        backend.store.persist(30)
        pool.clear()
        assert backend.batch_exists(hashes) == 2
    finally:
        backend.close()


def test_a_set_begun_before_clear_is_not_visible_after_it(sgl: sh.Sglang, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's backup thread is inside batch_set_v1 (old-weight pages) when clear() runs on another
    thread: those pages must not land under the new epoch."""
    backend, pool = make(sgl)
    try:
        hashes = sh.page_hashes(sgl, list(range(3 * PAGE)), PAGE)
        entered, release = threading.Event(), threading.Event()
        pages_of = backend._pages

        def slow_pages(*a: Any, **k: Any) -> Any:
            entered.set()
            release.wait(30)
            return pages_of(*a, **k)

        monkeypatch.setattr(backend, "_pages", slow_pages)
        result: list[Any] = []
        setter = threading.Thread(target=lambda: result.append(backend.batch_set_v1(hashes, pool.alloc(3 * PAGE))))
        setter.start()
        assert entered.wait(30)
        clearer = threading.Thread(target=backend.clear)
        clearer.start()
        clearer.join(0.2)  # clear() waits for the set in flight (a stuck set would only delay it)
        release.set()
        setter.join(30)
        clearer.join(30)
        assert not setter.is_alive() and not clearer.is_alive()
        assert result == [[True] * 3]
        backend.store.persist(30)
        assert backend.batch_exists(hashes) == 0
    finally:
        backend.close()


def test_mla_ranks_agree_on_the_epoch_after_a_clear(sgl: sh.Sglang, tmp_path: Path) -> None:
    """MLA: one namespace for all ranks, written by rank 0. After the flush every rank ran, rank 1
    restores rank 0's new pages and neither restores the pages from before it."""
    shared = {**SMALL, "host_capacity_bytes": 0, "object_url": f"file://{tmp_path / 'obj'}", "object_refresh_s": None}
    old = sh.page_hashes(sgl, list(range(2 * PAGE)), PAGE)
    new = sh.page_hashes(sgl, list(range(1000, 1000 + 3 * PAGE)), PAGE)

    def rank(r: int) -> tuple[Any, Any]:
        pool = sh.mla_host_pool(sgl, "page_first", layers=LAYERS, kv_lora_rank=32, rope_dim=8, page_size=PAGE,
                                pages=16)
        conf = sh.storage_config(sgl, sh.backend_extra(**shared), tp_rank=r, tp_size=2, is_mla=True)
        return sh.attach(sgl, conf, pool), pool

    writer, pool = rank(0)
    writer.batch_set_v1(old, pool.alloc(2 * PAGE))
    writer.store.persist(30)
    pool.clear()  # the flush, on rank 0 ...
    writer.batch_set_v1(new, pool.alloc(3 * PAGE))
    writer.store.persist(30)
    writer.close()
    reader, reader_pool = rank(1)
    try:
        reader_pool.clear()  # ... and on rank 1
        end = time.monotonic() + 15
        while reader.batch_exists(new) < 3 and time.monotonic() < end:
            time.sleep(0.05)  # the object tier indexes in the background
        assert reader.batch_exists(new) == 3
        assert reader.batch_get_v1(new, reader_pool.alloc(3 * PAGE)) == [True] * 3
        assert reader.batch_exists(old) == 0
    finally:
        reader.close()


def test_epochs_differ_per_reset_and_weight_version() -> None:
    a, b = KeyEpoch(), KeyEpoch()
    assert a.value == b"" and a.advance("v1") == b.advance("v1")  # two ranks, one reset: one epoch
    first = a.value
    assert a.advance("v1") != first and a.resets == 2  # a second reset at the same version still moves
    seen = {KeyEpoch("t").advance("v1"), KeyEpoch("t").advance("v2"), KeyEpoch("u").advance("v1"), a.value}
    assert len(seen) == 4


def test_launch_token_is_shared_through_the_process_group_store() -> None:
    import torch.distributed as dist

    assert launch_token() == ""  # no process group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        token = launch_token()
        assert token and launch_token() == token  # a second rank reads the first rank's token
    finally:
        dist.destroy_process_group()


def test_close_gives_the_host_pool_its_clear_back(sgl: sh.Sglang) -> None:
    """A detached backend no longer hangs on the pool; the next attached one gets every flush."""
    backend, pool = make(sgl)
    backend.close()
    assert getattr(pool.clear, "__self__", None) is pool  # SGLang's own bound method again
    again = sh.attach(sgl, backend.storage_config, pool)
    try:
        pool.clear()
        assert again._epoch.resets == 1
    finally:
        again.close()
