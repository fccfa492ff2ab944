"""An expiry pass leaves no byte of an expired block on the SSD: sealed, open and emptied segments."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_tiered_kv.hints import BlockRetention
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.ssd import SSDTier
from dynamo_tiered_kv.tiers.ssd.space import allocated_segment_bytes, bytes_held_by
from tests.test_store import NS, REC, keys_for
from tests.test_store_retain_api import Clock, _offload


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(8 * REC, 4, pin=False)
    yield p
    p.close()


def test_one_expiry_pass_frees_every_expired_byte_on_the_ssd(pool: StagingPool, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, segment_bytes=64 << 10, idle_seal_s=None)
    clock = Clock()
    with TieredStore([HostTier(8 * REC, chunk_bytes=REC, pin=False), ssd], NS, pool, clock=clock) as store:
        expiring = keys_for(24)
        kept = keys_for(9, start=999 * 16)
        store.retain(expiring, BlockRetention(50, clock.t + 60))
        for j in range(3):  # expiring and kept records share segments; the open one ends up holding expiring ones
            _offload(store, kept[j * 3:(j + 1) * 3])
            _offload(store, expiring[j * 8:(j + 1) * 8])
        assert all(ssd.contains(k) for k in expiring)
        assert bytes_held_by(tmp_path / "ssd", {expiring[-1]}) > 0  # in the open segment
        before = allocated_segment_bytes(tmp_path / "ssd")
        assert bytes_held_by(tmp_path / "ssd", set(expiring)) > 0

        batches: list[int] = []
        real = ssd.delete_many

        async def counted(keys):  # type: ignore[no-untyped-def]
            keys = list(keys)
            batches.append(len(keys))
            return await real(keys)

        async def one_by_one(key: bytes) -> bool:
            raise AssertionError("an expiry pass deletes in batches")

        monkeypatch.setattr(ssd, "delete_many", counted)
        monkeypatch.setattr(ssd, "delete", one_by_one)
        clock.t += 61
        rep = store.expire()
        assert rep.blocks["ssd"] == 24 and batches == [24]
        assert not any(ssd.contains(k) for k in expiring)
        assert bytes_held_by(tmp_path / "ssd", set(expiring)) == 0
        assert allocated_segment_bytes(tmp_path / "ssd") < before
        assert all(ssd.contains(k) for k in kept)
