"""The SGLang HiCache backend against the real sglang 0.5.23: built by SGLang's own
``StorageBackendFactory`` (``dynamic``), driven with SGLang's ``MHATokenToKVPoolHost`` on CPU
tensors and SGLang's own page hashes, over every tier set under it (host, SSD, objects, all).

The oracle for page contents is SGLang's ``get_data_page``, never our layout views.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dynamo_tiered_kv.blocks.codec import header_bytes

pytest.importorskip("sglang", reason="sglang 0.5.23 not installed (bash .ci/install-sglang.sh)")
from dynamo_tiered_kv.connectors.sglang import TieredHiCacheStorage
from dynamo_tiered_kv.testing import sglang_host as sh

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 16, 4
LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]
TIER_SETS = {
    "host": lambda d: {"host_capacity_bytes": 4 << 20},
    "ssd": lambda d: {"host_capacity_bytes": 0, "ssd_dir": str(d / "ssd"), "ssd_io": "buffered"},
    "objects": lambda d: {"host_capacity_bytes": 0, "object_url": f"file://{d / 'obj'}", "object_refresh_s": None},
    "all": lambda d: {"host_capacity_bytes": 4 << 20, "ssd_dir": str(d / "ssd"), "ssd_io": "buffered",
                      "object_url": f"file://{d / 'obj'}", "object_refresh_s": None},
}
SMALL = {"staging_slab_bytes": 1 << 20, "staging_slabs": 4}


@pytest.fixture(scope="module")
def sgl() -> sh.Sglang:
    s = sh.load_sglang()
    assert s.version == sh.SGLANG_VERSION
    return s


def make(sgl: sh.Sglang, tmp: Path, tiers: str, layout: str = "page_first", pages: int = 32,
         **cfg: Any) -> tuple[Any, Any]:
    pool = sh.mha_host_pool(sgl, layout, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE, pages=pages)
    settings = {**SMALL, **TIER_SETS[tiers](tmp), **cfg}
    model = settings.pop("model_name", "test-model")
    tp_rank, tp_size = settings.pop("tp_rank", 0), settings.pop("tp_size", 1)
    conf = sh.storage_config(sgl, sh.backend_extra(**settings), model_name=model, tp_rank=tp_rank, tp_size=tp_size)
    backend = sh.attach(sgl, conf, pool)
    return backend, pool


def fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-2**15, 2**15, pool.kv_buffer.shape, generator=g,
                                                          dtype=torch.int16))


def pages_of(pool: Any, idx: torch.Tensor) -> list[torch.Tensor]:
    return [pool.get_data_page(int(idx[i]), flat=True).view(torch.int16).clone() for i in range(0, len(idx), PAGE)]


def settle(backend: Any) -> None:
    """Queued offloads written, open SSD segment sealed, sealed segments flushed to objects."""
    backend.store.persist(30)


def index_ready(backend: Any, timeout: float = 15.0) -> None:
    """A fresh object tier builds its index in the background (misses until then): wait for it."""
    end = time.monotonic() + timeout
    for t in backend.store.tiers:
        while not getattr(t, "index_ready", True) and time.monotonic() < end:
            time.sleep(0.05)


def tokens(n_pages: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_pages * PAGE)]


@pytest.mark.parametrize("tiers", list(TIER_SETS))
class TestBackendOverTiers:
    def test_dynamic_loader_builds_it(self, sgl: sh.Sglang, tmp_path: Path, tiers: str) -> None:
        backend, _ = make(sgl, tmp_path, tiers)
        try:
            assert isinstance(backend, TieredHiCacheStorage)
            expect = {"host": ["host"], "ssd": ["ssd"], "objects": ["object"], "all": ["host", "ssd", "object"]}
            assert [t.name for t in backend.store.tiers] == expect[tiers]
        finally:
            backend.close()

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_pages_round_trip(self, sgl: sh.Sglang, tmp_path: Path, tiers: str, layout: str) -> None:
        backend, pool = make(sgl, tmp_path, tiers, layout)
        try:
            hashes = sh.page_hashes(sgl, tokens(5), PAGE)
            src = pool.alloc(5 * PAGE)
            fill(pool, 1)
            want = pages_of(pool, src)
            assert backend.batch_exists(hashes) == 0
            assert backend.batch_set_v1(hashes, src) == [True] * 5
            settle(backend)
            assert backend.batch_exists(hashes) == 5
            dst = pool.alloc(5 * PAGE)
            assert not any(torch.equal(a, b) for a, b in zip(want, pages_of(pool, dst)))
            assert backend.batch_get_v1(hashes, dst) == [True] * 5
            got = pages_of(pool, dst)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
        finally:
            backend.close()

    def test_exists_is_the_leading_run_from_memory(self, sgl: sh.Sglang, tmp_path: Path, tiers: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        backend, pool = make(sgl, tmp_path, tiers)
        try:
            hashes = sh.page_hashes(sgl, tokens(6), PAGE)
            src = pool.alloc(3 * PAGE)
            fill(pool, 2)
            backend.batch_set_v1(hashes[:3], src)
            settle(backend)

            def no_io(*a: Any, **k: Any) -> Any:
                raise AssertionError("batch_exists did I/O")

            for t in backend.store.tiers:
                for name in ("read_into", "read_many", "read_slab", "read_slab_now", "pin_records"):
                    if hasattr(t, name):
                        monkeypatch.setattr(t, name, no_io)
            assert backend.batch_exists(hashes) == 3
            assert backend.batch_exists([hashes[0], "f" * 64, hashes[2]]) == 1
            assert backend.batch_exists(hashes[3:]) == 0
            assert backend.exists(hashes[1]) and not backend.exists(hashes[4])
        finally:
            backend.close()

    def test_failing_tier_is_a_miss_not_a_crash(self, sgl: sh.Sglang, tmp_path: Path, tiers: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
        backend, pool = make(sgl, tmp_path, tiers, load_timeout_s=5.0)
        try:
            hashes = sh.page_hashes(sgl, tokens(4), PAGE)
            backend.batch_set_v1(hashes, pool.alloc(4 * PAGE))
            settle(backend)

            async def broken(*a: Any, **k: Any) -> Any:
                raise OSError("disk on fire")

            def broken_sync(*a: Any, **k: Any) -> Any:
                raise OSError("disk on fire")

            for t in backend.store.tiers:
                for name in ("read_into", "read_many", "read_slab", "write_many"):
                    if hasattr(t, name):
                        monkeypatch.setattr(t, name, broken)
                for name in ("pin_records", "read_slab_now"):  # host zero-copy read, SSD one-chunk read
                    if hasattr(t, name):
                        monkeypatch.setattr(t, name, broken_sync)
            t0 = time.monotonic()
            assert backend.batch_get_v1(hashes, pool.alloc(4 * PAGE)) == [False] * 4
            assert time.monotonic() - t0 < 5.0
            more = sh.page_hashes(sgl, tokens(2, base=10_000), PAGE)
            backend.batch_set_v1(more, pool.alloc(2 * PAGE))  # accepted or dropped, never raised
            backend.store.drain(10)
            assert backend.batch_exists(more) == 0
        finally:
            backend.close()

    def test_clear_makes_pages_unreachable(self, sgl: sh.Sglang, tmp_path: Path, tiers: str) -> None:
        backend, pool = make(sgl, tmp_path, tiers)
        try:
            hashes = sh.page_hashes(sgl, tokens(3), PAGE)
            backend.batch_set_v1(hashes, pool.alloc(3 * PAGE))
            settle(backend)
            assert backend.batch_exists(hashes) == 3
            backend.clear()
            assert backend.batch_exists(hashes) == 0
            assert backend.batch_get_v1(hashes, pool.alloc(3 * PAGE)) == [False] * 3
        finally:
            backend.close()


@pytest.mark.parametrize("tiers", ["ssd", "objects"])
def test_corrupt_page_is_never_served(sgl: sh.Sglang, tmp_path: Path, tiers: str) -> None:
    tier = {"ssd": "ssd", "objects": "object"}[tiers]
    """Flip one payload byte of the second page's record on disk: pages 2.. are misses."""
    backend, pool = make(sgl, tmp_path, tiers)
    try:
        hashes = sh.page_hashes(sgl, tokens(3), PAGE)
        src = pool.alloc(3 * PAGE)
        fill(pool, 3)
        want = pages_of(pool, src)
        backend.batch_set_v1(hashes, src)
        settle(backend)
        key = backend.keys_of(hashes[1:2])[0]
        hit = 0
        for f in (p for p in tmp_path.rglob("*") if p.is_file()):
            data = bytearray(f.read_bytes())
            pos = data.find(key)
            while pos >= 32:
                if data[pos - 32:pos - 24] == b"DTKVBLK\x00":  # the record header; the key is at byte 32
                    data[pos - 32 + header_bytes(LAYERS) + 5] ^= 0xFF
                    hit += 1
                pos = data.find(key, pos + 1)
            f.write_bytes(bytes(data))
        assert hit >= 1
        before = backend.store.metrics.checksum_failures.labels(tier)._value.get()
        dst = pool.alloc(3 * PAGE)
        assert backend.batch_get_v1(hashes, dst) == [True, False, False]
        assert torch.equal(pages_of(pool, dst)[0], want[0])
        assert backend.store.metrics.checksum_failures.labels(tier)._value.get() == before + 1
    finally:
        backend.close()


def test_namespaces_isolate_tenants_models_and_ranks(sgl: sh.Sglang, tmp_path: Path) -> None:
    """One shared object tier; only an identical tenant, model and TP rank sees the pages."""
    shared = {"host_capacity_bytes": 0, "object_url": f"file://{tmp_path / 'obj'}", "object_refresh_s": None}
    hashes = sh.page_hashes(sgl, tokens(3), PAGE)

    def backend(**cfg: Any) -> Any:
        pool = sh.mha_host_pool(sgl, "page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                                pages=16)
        model, tp_rank = cfg.pop("model_name", "m"), cfg.pop("tp_rank", 0)
        conf = sh.storage_config(sgl, sh.backend_extra(**SMALL, **shared, **cfg), model_name=model,
                                 tp_rank=tp_rank, tp_size=2)
        return sh.attach(sgl, conf, pool), pool

    writer, pool = backend(tenant_salt="a")
    writer.batch_set_v1(hashes, pool.alloc(3 * PAGE))
    settle(writer)
    writer.close()
    seen = {}
    for name, cfg in {"same": {"tenant_salt": "a"}, "tenant": {"tenant_salt": "b"},
                      "model": {"tenant_salt": "a", "model_name": "other"},
                      "rank": {"tenant_salt": "a", "tp_rank": 1}}.items():
        reader, _ = backend(**cfg)
        index_ready(reader)
        seen[name] = reader.batch_exists(hashes)
        reader.close()
    assert seen == {"same": 3, "tenant": 0, "model": 0, "rank": 0}


def test_prefix_keys_chain_the_parent(sgl: sh.Sglang, tmp_path: Path) -> None:
    """Pages saved in two batches (SGLang passes the earlier hashes as prefix_keys) restore as one run."""
    backend, pool = make(sgl, tmp_path, "host")
    try:
        hashes = sh.page_hashes(sgl, tokens(4), PAGE)
        src = pool.alloc(4 * PAGE)
        fill(pool, 4)
        want = pages_of(pool, src)
        backend.batch_set_v1(hashes[:2], src[:2 * PAGE])
        extra = sgl.HiCacheStorageExtraInfo(prefix_keys=hashes[:2])
        backend.batch_set_v1(hashes[2:], src[2 * PAGE:], extra)
        settle(backend)
        dst = pool.alloc(4 * PAGE)
        assert backend.batch_get_v1(hashes, dst) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(want, pages_of(pool, dst)))
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pages_written_once_read_by_every_rank(sgl: sh.Sglang, tmp_path: Path, layout: str) -> None:
    """MLA KV is the same on every TP rank: SGLang's writer rank stores it, the others store
    nothing and restore the writer's pages (one namespace, TP 0 of 1)."""
    shared = {**SMALL, "host_capacity_bytes": 0, "object_url": f"file://{tmp_path / 'obj'}", "object_refresh_s": None}
    hashes = sh.page_hashes(sgl, tokens(3), PAGE)

    def rank(r: int) -> tuple[Any, Any]:
        pool = sh.mla_host_pool(sgl, layout, layers=LAYERS, kv_lora_rank=32, rope_dim=8, page_size=PAGE, pages=16)
        conf = sh.storage_config(sgl, sh.backend_extra(**shared), tp_rank=r, tp_size=2, is_mla=True)
        return sh.attach(sgl, conf, pool), pool

    other, other_pool = rank(1)
    assert other.batch_set_v1(hashes, other_pool.alloc(3 * PAGE)) == [True] * 3  # SGLang's contract: not ours
    other.store.persist(30)
    assert other.batch_exists(hashes) == 0  # ... so nothing was written
    writer, pool = rank(0)
    src = pool.alloc(3 * PAGE)
    fill(pool, 5)
    want = pages_of(pool, src)
    writer.batch_set_v1(hashes, src)
    settle(writer)
    writer.close()
    reader, reader_pool = rank(1)
    index_ready(reader)
    dst = reader_pool.alloc(3 * PAGE)
    assert reader.batch_get_v1(hashes, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(want, pages_of(reader_pool, dst)))
    reader.close()
    other.close()


def test_legacy_interface_answers_misses(sgl: sh.Sglang, tmp_path: Path) -> None:
    backend, pool = make(sgl, tmp_path, "host")
    try:
        page = pool.get_data_page(0)
        assert backend.set("k", page) is False and backend.batch_set(["k"], [page]) is False
        assert backend.get("k") is None and backend.batch_get(["k"]) == [None]
    finally:
        backend.close()


def test_unknown_setting_is_refused(sgl: sh.Sglang, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="ssd_dirr"):
        make(sgl, tmp_path, "host", ssd_dirr="/x")
