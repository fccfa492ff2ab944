"""The object tier's ranged GETs follow the bucket: ``sizing.piece_bytes`` (first-byte latency x
throughput, 8-64 MiB, 64 MiB while the window is cold), ``ObjectTier.read_piece_bytes`` over the
backend's GET window, and the GETs a restore through ``TieredStore.load`` then sends (moto)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.blocks.codec import record_bytes
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store.store import TieredStore
from dynamo_tiered_kv.tenants.sealed_tier import SealedTier
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier, S3Backend
from dynamo_tiered_kv.tiers.objectstore.latency import MIN_SAMPLES, WINDOW, GetLatency
from dynamo_tiered_kv.tiers.objectstore.sizing import (
    MAX_PIECE_BYTES,
    MIN_PIECE_BYTES,
    MiB,
    piece_bytes,
    window_piece_bytes,
)

pytest_plugins = ["infra.fixtures_s3"]

# 256 KiB blocks: 128 of them are a 32 MiB prefix, enough for pieces of 8 MiB to show
BS, LAYERS, HEADS, HEAD = 16, 4, 8, 128
NS = Namespace("sizing", "bfloat16", "VLLM_CPU", BS, LAYERS, HEADS, HEAD)
BLOCKS = 128


def _feed(window: GetLatency, first_byte_s: float, bytes_per_s: float, n: int = WINDOW) -> None:
    """``n`` GETs of 64 MiB that answered after ``first_byte_s`` and streamed at ``bytes_per_s``
    (a full window: the few GETs a test's own restore records hardly move its estimates)."""
    for _ in range(n):
        window.first_byte(first_byte_s)
        window.transfer(64 * MiB, 64 * MiB / bytes_per_s)


# --- the rule --------------------------------------------------------------------------------
def test_a_cold_window_reads_in_the_largest_pieces() -> None:
    assert piece_bytes(None, None) == MAX_PIECE_BYTES == 64 * MiB
    assert piece_bytes(0.002, None) == MAX_PIECE_BYTES  # latency known, throughput not yet
    assert piece_bytes(None, 1e9) == MAX_PIECE_BYTES
    assert piece_bytes(math.nan, 1e9) == MAX_PIECE_BYTES and piece_bytes(0.01, 0.0) == MAX_PIECE_BYTES
    window = GetLatency()
    _feed(window, 0.001, 1e9, n=MIN_SAMPLES - 1)  # one GET short of an estimate
    assert window_piece_bytes(window) == MAX_PIECE_BYTES
    assert window_piece_bytes(None) == MAX_PIECE_BYTES  # a backend that keeps no window


def test_low_latency_and_a_high_rate_read_in_the_smallest_pieces() -> None:
    assert piece_bytes(0.0005, 1e9) == MIN_PIECE_BYTES == 8 * MiB  # 9 x 0.5 ms x 1 GB/s = 4.5 MB
    assert piece_bytes(0.0, 5e9) == MIN_PIECE_BYTES
    window = GetLatency()
    _feed(window, 0.0005, 1e9, n=MIN_SAMPLES)
    assert window_piece_bytes(window) == MIN_PIECE_BYTES


def test_pieces_grow_with_latency_in_whole_mib_up_to_the_cap() -> None:
    # 9 x 20 ms x 100 MB/s = 18 MB = 17.2 MiB: rounded up, so the latency stays under a tenth
    assert piece_bytes(0.020, 100e6) == 18 * MiB
    assert piece_bytes(0.040, 100e6) == 35 * MiB  # 36 MB = 34.3 MiB
    assert piece_bytes(0.080, 100e6) == MAX_PIECE_BYTES  # 72 MB: capped
    assert piece_bytes(10.0, 1e12) == MAX_PIECE_BYTES  # a stalled gateway's censored samples
    for first in (0.001, 0.005, 0.02, 0.05, 0.2):
        b = piece_bytes(first, 200e6)
        assert b % MiB == 0 and MIN_PIECE_BYTES <= b <= MAX_PIECE_BYTES
        if MIN_PIECE_BYTES < b < MAX_PIECE_BYTES:
            assert first / (first + b / 200e6) <= 0.1  # >= 90% of the GET is transfer


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="bounds"):
        piece_bytes(0.01, 1e8, min_bytes=64 * MiB, max_bytes=8 * MiB)
    with pytest.raises(ValueError, match="bounds"):
        piece_bytes(0.01, 1e8, min_bytes=MiB + 1)
    with pytest.raises(ValueError, match="k must be positive"):
        piece_bytes(0.01, 1e8, k=0)


# --- the tier ----------------------------------------------------------------------------------
def test_object_tier_piece_follows_its_backends_window(moto_s3: S3Server) -> None:
    backend = S3Backend(unique_bucket("size"), **moto_s3.backend_kwargs())
    tier = ObjectTier(backend, namespace=NS.digest)  # a namespaced tier: the window is the root's
    sealed = SealedTier(tier, lambda: None)  # type: ignore[arg-type,return-value]  # never opened here
    assert tier.read_piece_bytes == MAX_PIECE_BYTES  # cold: few, large requests
    _feed(backend.latency, 0.0005, 1e9)
    assert tier.read_piece_bytes == MIN_PIECE_BYTES
    assert sealed.read_piece_bytes == MIN_PIECE_BYTES  # the sealed tier follows, not a copy
    _feed(backend.latency, 0.020, 100e6)
    assert tier.read_piece_bytes == sealed.read_piece_bytes == 18 * MiB
    _feed(backend.latency, 0.200, 100e6)  # an HDD-backed bucket under load
    assert tier.read_piece_bytes == MAX_PIECE_BYTES
    tier.read_piece_bytes = 4 * MiB  # set by hand: kept whatever the window says
    _feed(backend.latency, 0.0005, 1e9)
    assert tier.read_piece_bytes == sealed.read_piece_bytes == 4 * MiB
    tier.read_piece_bytes = None  # sized again
    assert tier.read_piece_bytes == MIN_PIECE_BYTES
    assert type(tier.read_piece_bytes) is int  # the declared type (tiers/base.py)


def test_a_backend_without_a_window_keeps_the_largest_pieces(tmp_path) -> None:
    tier = ObjectTier(LocalDirBackend(tmp_path / "obj"))
    assert tier.read_piece_bytes == MAX_PIECE_BYTES and type(tier.read_piece_bytes) is int


# --- a restore ---------------------------------------------------------------------------------
def _layout(num_blocks: int, seed: int | None = None) -> EngineLayout:
    tensors = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=LAYERS, num_blocks=num_blocks,
                                 block_size=BS, num_kv_heads=HEADS, head_size=HEAD)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return EngineLayout(EngineLayoutKind.VLLM_CPU, tensors, BS, HEADS, HEAD)


@pytest.fixture
def stored(moto_s3: S3Server) -> Iterator[tuple[TieredStore, ObjectTier, S3Backend, EngineLayout, list[bytes]]]:
    """A store whose only tier is an object tier on moto, holding one 32 MiB prefix in one data
    object (blocks 1..BLOCKS of the layout); staging slabs hold the whole prefix (one chunk)."""
    backend = S3Backend(unique_bucket("size"), **moto_s3.backend_kwargs())
    tier = ObjectTier(backend)
    pool = StagingPool(40 * MiB, 3, pin=False)
    layout = _layout(2 * BLOCKS + 1, seed=3)
    keys = chain_keys(NS, torch.arange(BLOCKS * BS).numpy() % 1000)
    store = TieredStore([tier], NS, pool)
    try:
        assert store._call(tier.wait_ready(30), 40)
        assert store.submit_offload(layout, list(range(1, BLOCKS + 1)), keys, parents_of(keys))
        assert store.drain(60)
        assert len({tier.location(k)[0] for k in keys}) == 1  # type: ignore[index]  # one run
        yield store, tier, backend, layout, keys
    finally:
        store.close()
        pool.close()


def _restore_gets(store: TieredStore, backend: S3Backend, layout: EngineLayout, keys: list[bytes]) -> int:
    """GETs one restore of the prefix into blocks BLOCKS+1.. sent; checks every byte arrived."""
    dst = list(range(BLOCKS + 1, 2 * BLOCKS + 1))
    for t in layout.tensors:
        t[dst] = 0
    before = backend.stats.gets
    res = store.load(layout, dst, keys, timeout=60)
    assert res.loaded_block_ids == dst and res.stages.chunks == 1
    for t in layout.tensors:
        assert torch.equal(t[1:BLOCKS + 1], t[BLOCKS + 1:2 * BLOCKS + 1])
    return backend.stats.gets - before


def test_a_fast_bucket_restores_a_chunk_in_several_smallest_pieces(stored) -> None:
    store, tier, backend, layout, keys = stored
    rb = record_bytes(layout.shape)
    assert BLOCKS * rb // MIN_PIECE_BYTES == 4  # 32 MiB and headers
    _feed(backend.latency, 0.0005, 1e9)  # 0.5 ms to the first byte, 1 GB/s per GET
    assert tier.read_piece_bytes == MIN_PIECE_BYTES
    assert _restore_gets(store, backend, layout, keys) == 4  # one chunk, one run, 8 MiB pieces


def test_a_slow_bucket_restores_a_chunk_in_one_get(stored) -> None:
    store, tier, backend, layout, keys = stored
    _feed(backend.latency, 0.050, 200e6)  # 9 x 50 ms x 200 MB/s = 90 MB: the cap
    assert tier.read_piece_bytes == MAX_PIECE_BYTES
    assert _restore_gets(store, backend, layout, keys) == 1
