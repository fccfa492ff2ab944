"""``TieredStore.load_into``: records read from the SSD straight into the caller's buffers (one per
block) and verified there; real segment files (O_DIRECT where the filesystem takes it)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from infra.s3util import count_slab_takes

from dynamo_tiered_kv.blocks.codec import header_bytes, record_bytes
from dynamo_tiered_kv.blocks.keys import ROOT_KEY, BlockKey, Namespace, chain_keys
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store.store import TieredStore
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.ssd.tier import SSDTier

N = 12


@dataclass
class Rig:
    store: TieredStore
    rows: np.ndarray  # (N, row bytes): the caller's blocks, one contiguous row each
    layout: EngineLayout
    keys: list[BlockKey]
    saved: np.ndarray
    ssd: SSDTier

    def acquisitions(self) -> list[int]:
        """Counts every staging slab taken from now on (the count is element 0)."""
        return count_slab_takes(self.store.staging)


def _rig(tmp_path: Path, row: int, host: bool = False) -> Iterator[Rig]:
    rows = np.zeros((N, row), np.uint8)
    layout = EngineLayout(EngineLayoutKind.VLLM_CPU, [torch.from_numpy(rows).reshape(N, 1, 1, row)], block_size=1,
                          num_kv_heads=1, head_size=row // 2)
    ns = Namespace("into-buffers", "bfloat16", "VLLM_CPU", 1, 1, 1, row // 2)
    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=64 << 20, segment_bytes=16 << 20, namespace=ns.digest)
    tiers = [HostTier(32 << 20), ssd] if host else [ssd]
    pool = StagingPool(1 << 20, 4, pin=False)
    store = TieredStore(tiers, ns, pool, write_depth=len(tiers))
    try:
        rng = np.random.default_rng(row)
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
        saved = rows.copy()
        keys = chain_keys(ns, list(range(N)))  # one token per block
        parents = [ROOT_KEY, *keys[:-1]]
        assert store.submit_offload(layout, list(range(N)), keys, parents)
        assert store.drain(30)
        rows[:] = 0
        yield Rig(store, rows, layout, keys, saved, ssd)
    finally:
        store.close()
        pool.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    # 10240-byte rows: 512-aligned, not a page multiple, so each record is header + row + padding
    yield from _rig(tmp_path, 10240)


def test_records_are_read_straight_into_the_callers_buffers(rig: Rig) -> None:
    taken = rig.acquisitions()
    res = rig.store.load_into(rig.layout.shape, list(rig.rows), rig.keys, timeout=30)
    assert (res.restored, res.planned) == (N, N)
    assert res.tier_per_block == ["ssd"] * N
    assert np.array_equal(rig.rows, rig.saved)
    assert taken[0] == 0  # no staging slab: nothing went through a slab and a scatter copy


def test_rows_too_odd_for_direct_io_are_read_through_a_bounce(tmp_path: Path) -> None:
    for r in _rig(tmp_path, 10000):  # not a multiple of 512
        res = r.store.load_into(r.layout.shape, list(r.rows), r.keys, timeout=30)
        assert res.restored == N
        assert np.array_equal(r.rows, r.saved)


def _flip(ssd_dir: Path, at: int) -> None:
    (seg,) = [p for p in ssd_dir.rglob("*") if p.is_file() and p.suffix == ".dtkv"]
    with open(seg, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def _record_offset(rig: Rig, i: int) -> int:
    """File offset of block i's record: the records of one offload lie back to back from the first."""
    (seg,) = [p for p in (rig.ssd.rank_dir).rglob("*") if p.is_file() and p.suffix == ".dtkv"]
    data = seg.read_bytes()
    first = data.find(bytes(rig.keys[0]))
    assert first >= 0
    start = first - 32  # the key lies at bytes [32, 48) of a record
    return start + i * record_bytes(rig.layout.shape)


def test_a_corrupt_payload_fails_its_block_and_every_later_one(rig: Rig) -> None:
    _flip(rig.ssd.rank_dir, _record_offset(rig, 5) + header_bytes(1) + 777)
    res = rig.store.load_into(rig.layout.shape, list(rig.rows), rig.keys, timeout=30)
    assert (res.restored, res.planned) == (5, N)
    assert np.array_equal(rig.rows[:5], rig.saved[:5])
    assert rig.store.metrics.value("checksum_failures", tier="ssd") == 1
    assert rig.store.lookup(rig.keys).num_blocks == 5  # condemned: never served again


def test_a_corrupt_header_fails_its_block(rig: Rig) -> None:
    _flip(rig.ssd.rank_dir, _record_offset(rig, 0) + 40)  # inside the key field
    res = rig.store.load_into(rig.layout.shape, list(rig.rows), rig.keys, timeout=30)
    assert res.restored == 0
    assert rig.store.metrics.value("checksum_failures", tier="ssd") == 1


def test_blocks_of_a_tier_without_such_reads_are_left_to_load(tmp_path: Path) -> None:
    for r in _rig(tmp_path, 8192, host=True):  # every block is in host memory first
        res = r.store.load_into(r.layout.shape, list(r.rows), r.keys, timeout=30)
        assert (res.restored, res.planned) == (0, 0)
        assert len(r.store.load(r.layout, list(range(N)), r.keys, timeout=30).loaded_block_ids) == N
        assert np.array_equal(r.rows, r.saved)


def test_destinations_of_the_wrong_size_are_refused(rig: Rig) -> None:
    with pytest.raises(ValueError, match="writable contiguous uint8"):
        rig.store.load_into(rig.layout.shape, [r[:-2] for r in rig.rows], rig.keys, timeout=30)


def test_a_read_in_flight_at_the_deadline_is_waited_for_before_returning(rig: Rig) -> None:
    """The caller's buffers are its own memory: a read still writing into them when the deadline
    passes is waited for, so nothing lands in them after ``load_into`` returned."""
    real, gate, finished = rig.ssd.read_split_now, threading.Event(), threading.Event()

    def stalled(keys, parts, rb):  # type: ignore[no-untyped-def]
        gate.wait(10)
        try:
            return real(keys, parts, rb)
        finally:
            finished.set()

    rig.ssd.read_split_now = stalled  # type: ignore[method-assign]
    threading.Timer(0.5, gate.set).start()
    res = rig.store.load_into(rig.layout.shape, list(rig.rows), rig.keys, timeout=0.05)
    assert finished.is_set()  # the read returned before the call did
    assert res.restored == 0 and res.planned == N and res.waited_past_deadline
    assert rig.store.metrics.value("restores_abandoned", reason="deadline") == 1
