"""A write whose records are durable never reports failure because the automatic seal after it
failed: the seal is retried later, and a batch that stops partway says how
many of its records are stored (``PartialWrite``), which the store accounts as written."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.blocks.keys import Namespace
from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.testing.ssd import open_ssd_tier
from dynamo_tiered_kv.testing.ssd import read_whole as read
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.segments import SealedSegment
from dynamo_tiered_kv.tiers.ssd import SSDTier
from dynamo_tiered_kv.tiers.ssd.segment import SEG_MAGIC, TRAILER, list_segments, read_footer

SHAPE = small_shape(num_layers=2)  # 12 KiB records: five fill a 64 KiB segment


def rec(i: int) -> tuple[bytes, bytes]:
    k = random_key(i, b"ssd-seal")
    return k, make_record(k, i, shape=SHAPE)


async def opened(path: Path, **kw) -> SSDTier:
    return await open_ssd_tier(path, segment_bytes=64 << 10, io="buffered", **kw)


def fail_seals(t: SSDTier, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Footer writes fail with ENOSPC (record appends still work)."""
    from dynamo_tiered_kv.tiers.ssd import sealing as seal_mod  # footers are written there

    calls: list[int] = []
    real = seal_mod.write_extent

    def footer_enospc(io, fd, offset, arrays, bounce):
        last = np.asarray(arrays[-1]).view(np.uint8).reshape(-1)
        if bytes(last[-TRAILER.size:-TRAILER.size + 8]) == SEG_MAGIC:
            calls.append(offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(io, fd, offset, arrays, bounce)

    monkeypatch.setattr(seal_mod, "write_extent", footer_enospc)
    return calls


def footer_ok(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_footer(fd, os.fstat(fd).st_size) is not None
    finally:
        os.close(fd)


async def test_failed_automatic_seal_does_not_fail_a_durable_write(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    sealed: list[SealedSegment] = []
    t = await opened(tmp_path, write_retry_s=0.0, on_sealed=sealed.append)
    try:
        items = [rec(i) for i in range(5)]  # fills the segment: write_many seals it at the end
        calls = fail_seals(t, monkeypatch)
        await t.write_many((k, memoryview(v)) for k, v in items)  # must not raise: the records are stored
        assert calls and not sealed
        assert all([await read(t, k) == v for k, v in items])
        monkeypatch.undo()
        k, v = rec(5)
        await t.write(k, memoryview(v))  # the next write retries the seal first
        assert [s.segment_id for s in sealed] == [f"{t.rank_dir.name}/00000001"]
        assert footer_ok(list_segments(t.rank_dir)[0][1])
        assert await read(t, k) == v
    finally:
        await t.close()


async def test_failed_seal_is_retried_by_the_idle_seal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = await opened(tmp_path, write_retry_s=0.0)
    try:
        fail_seals(t, monkeypatch)
        await t.write_many((k, memoryview(v)) for k, v in [rec(i) for i in range(5)])
        monkeypatch.undo()
        assert t.readonly_reason  # ENOSPC: writes pause, but the seal must not be forgotten
        assert await t.seal_if_idle(3600.0) is not None  # pending: retried without waiting for idleness
        assert footer_ok(list_segments(t.rank_dir)[0][1])
    finally:
        await t.close()


async def test_batch_that_stops_partway_says_how_much_is_stored(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv.errors import PartialWrite

    t = await opened(tmp_path)
    try:
        items = [rec(i) for i in range(8)]  # five land in segment 1; sealing it fails before the rest
        fail_seals(t, monkeypatch)
        with pytest.raises(PartialWrite) as exc:
            await t.write_many((k, memoryview(v)) for k, v in items)
        assert isinstance(exc.value, TierUnavailable) and exc.value.written == 5
        assert [await read(t, k) == v for k, v in items] == [True] * 5 + [False] * 3
    finally:
        await t.close()


class _StopsPartway(HostTier):
    """Stores the first ``n`` items of a batch, then reports PartialWrite like the SSD tier."""

    def __init__(self, n: int) -> None:
        super().__init__(1 << 20, pin=False)
        self.n = n

    async def write_many(self, items) -> None:
        from dynamo_tiered_kv.errors import PartialWrite

        items = list(items)
        await super().write_many(items[:self.n])
        raise PartialWrite("disk full", written=self.n)


def test_store_accounts_the_stored_prefix_as_written() -> None:
    ns = Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 2, 2, 32)
    pool = StagingPool(1 << 20, 2, pin=False)
    tier = _StopsPartway(2)
    store = TieredStore([tier], ns, pool, ttl_s=[3600.0])
    try:
        items = [(k, memoryview(np.frombuffer(v, np.uint8))) for k, v in (rec(i) for i in range(4))]
        store._call(store.writer.write_tier(0, items), timeout=10)
        assert list(store._state.ttl[0]._written) == [k for k, _ in items[:2]]
    finally:
        store.close()
        pool.close()
