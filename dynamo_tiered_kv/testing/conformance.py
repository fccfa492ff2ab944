"""``TierConformanceTests``: the behaviour every tier backend must show.

Subclass it in a test module and implement ``make_tier`` (and ``reopen_tier`` for durable tiers)::

    class TestMyTier(TierConformanceTests):
        async def make_tier(self, tmp_path, capacity_bytes):
            return MyTier(tmp_path, capacity_bytes=capacity_bytes)

The suite needs pytest-asyncio in auto mode. Values are real codec records (tiers that rebuild
their index by scanning need real headers), of several sizes, all multiples of 4 KiB.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ..tiers.base import ByteRange, ReadRequest, Tier
from .records import make_record, random_key, small_shape

SHAPES = [small_shape(num_layers=n) for n in (1, 2, 5)]


def _rec(i: int, seed: int = 0, size_class: int = 1) -> tuple[bytes, bytes]:
    key = random_key(i)
    return key, make_record(key, seed * 1000 + i, shape=SHAPES[size_class % len(SHAPES)])


async def _read(tier: Tier, key: bytes, length: int | None = None, rng: ByteRange | None = None) -> bytes | None:
    n = length if length is not None else (tier.size_of(key) or 1)
    buf = bytearray(n)
    got = await tier.read_into(key, memoryview(buf), rng)
    return None if got is None else bytes(buf[:got])


class TierConformanceTests:
    """Shared behaviour tests. ``capacity_bytes`` is generous unless a test needs pressure."""

    capacity_bytes: int = 64 << 20
    #: set False for tiers whose capacity is enforced lazily (e.g. by a background GC)
    enforces_capacity_on_write: bool = True

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:
        raise NotImplementedError

    async def reopen_tier(self, tier: Tier, tmp_path: Path, capacity_bytes: int) -> Tier:
        """Close ``tier`` and open a new instance over the same storage (durable tiers)."""
        raise NotImplementedError

    @pytest.fixture
    async def tier(self, tmp_path: Path):
        t = await self.make_tier(tmp_path, self.capacity_bytes)
        await t.open()
        try:
            yield t
        finally:
            await t.close()

    # --- basics -----------------------------------------------------------------------
    async def test_missing_key_is_none(self, tier: Tier) -> None:
        key = random_key(999_999)
        assert not tier.contains(key)
        assert tier.size_of(key) is None
        assert await tier.read_into(key, memoryview(bytearray(4096))) is None
        assert await tier.delete(key) is False

    async def test_write_then_read_roundtrip(self, tier: Tier) -> None:
        for i in range(3):
            key, rec = _rec(i, size_class=i)
            await tier.write(key, memoryview(rec))
            assert tier.contains(key)
            assert tier.size_of(key) == len(rec)
            assert await _read(tier, key) == rec

    async def test_overwrite_replaces_value(self, tier: Tier) -> None:
        key, a = _rec(1, seed=1)
        _, b = _rec(1, seed=2, size_class=2)
        await tier.write(key, memoryview(a))
        await tier.write(key, memoryview(b))
        assert tier.size_of(key) == len(b)
        assert await _read(tier, key) == b

    async def test_delete(self, tier: Tier) -> None:
        key, rec = _rec(7)
        await tier.write(key, memoryview(rec))
        assert await tier.delete(key) is True
        assert not tier.contains(key)
        assert await _read(tier, key, len(rec)) is None
        assert key not in set(tier.keys())

    async def test_byte_range(self, tier: Tier) -> None:
        key, rec = _rec(3, size_class=2)
        await tier.write(key, memoryview(rec))
        for start, length in ((0, 4096), (4096, 8192), (len(rec) - 4096, 4096), (100, 1)):
            assert await _read(tier, key, length, ByteRange(start, length)) == rec[start : start + length]

    async def test_range_past_end_raises(self, tier: Tier) -> None:
        key, rec = _rec(4)
        await tier.write(key, memoryview(rec))
        with pytest.raises(ValueError):
            await tier.read_into(key, memoryview(bytearray(8192)), ByteRange(len(rec) - 4096, 8192))

    async def test_destination_too_small_raises(self, tier: Tier) -> None:
        key, rec = _rec(5)
        await tier.write(key, memoryview(rec))
        with pytest.raises(ValueError):
            await tier.read_into(key, memoryview(bytearray(len(rec) - 1)))

    async def test_batched_read_and_write_keep_order(self, tier: Tier) -> None:
        items = [_rec(100 + i, size_class=i) for i in range(6)]
        await tier.write_many((k, memoryview(v)) for k, v in items)
        missing = random_key(123_456)
        bufs = [bytearray(len(v)) for _, v in items] + [bytearray(4096)]
        reqs = [ReadRequest(k, memoryview(b)) for (k, _), b in zip(items, bufs)]
        reqs.append(ReadRequest(missing, memoryview(bufs[-1])))
        got = await tier.read_many(reqs)
        assert got[-1] is None
        for (_k, v), n, b in zip(items, got[:-1], bufs):
            assert n == len(v) and bytes(b) == v
        assert tier.contains_prefix([k for k, _ in items] + [missing]) == len(items)

    async def test_usage_accounts_bytes(self, tier: Tier) -> None:
        before = tier.usage()
        key, rec = _rec(8)
        await tier.write(key, memoryview(rec))
        after = tier.usage()
        assert after.num_blocks == before.num_blocks + 1
        assert after.used_bytes >= before.used_bytes + len(rec)
        assert after.capacity_bytes == before.capacity_bytes > 0

    async def test_keys_lists_everything(self, tier: Tier) -> None:
        items = [_rec(200 + i) for i in range(5)]
        for k, v in items:
            await tier.write(k, memoryview(v))
        assert {k for k, _ in items} <= set(tier.keys())

    async def test_concurrent_writes_and_reads(self, tier: Tier) -> None:
        items = [_rec(300 + i, size_class=i) for i in range(16)]
        await asyncio.gather(*(tier.write(k, memoryview(v)) for k, v in items))
        got = await asyncio.gather(*(_read(tier, k, len(v)) for k, v in items))
        assert got == [v for _, v in items]

    async def test_capacity_is_enforced(self, tmp_path: Path) -> None:
        rec_len = len(_rec(0, size_class=2)[1])
        cap = rec_len * 4 + rec_len // 2
        t = await self.make_tier(tmp_path / "cap", cap)
        await t.open()
        try:
            for i in range(12):
                k, v = _rec(400 + i, size_class=2)
                await t.write(k, memoryview(v))
                if self.enforces_capacity_on_write:
                    assert t.usage().used_bytes <= t.usage().capacity_bytes
            assert t.usage().used_bytes <= t.usage().capacity_bytes
            newest_key, newest = _rec(411, size_class=2)
            assert await _read(t, newest_key, len(newest)) == newest  # newest survives
            assert t.usage().num_blocks < 12
        finally:
            await t.close()

    async def test_durable_tier_survives_reopen(self, tmp_path: Path) -> None:
        t = await self.make_tier(tmp_path / "dur", self.capacity_bytes)
        if not t.capabilities.durable:
            await t.close()
            pytest.skip("tier is not durable")
        await t.open()
        items = [_rec(500 + i, size_class=i) for i in range(5)]
        await t.write_many((k, memoryview(v)) for k, v in items)
        t2 = await self.reopen_tier(t, tmp_path / "dur", self.capacity_bytes)
        try:
            for k, v in items:
                assert t2.contains(k)
                assert await _read(t2, k, len(v)) == v
        finally:
            await t2.close()

    # --- model-based ----------------------------------------------------------------------
    def test_stateful_against_dict_model(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        suite = self

        class TierMachine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.loop = asyncio.new_event_loop()
                path = tmp_path_factory.mktemp("stateful")
                self.tier = self.loop.run_until_complete(suite.make_tier(path, 64 << 20))
                self.loop.run_until_complete(self.tier.open())
                ready = getattr(self.tier, "wait_ready", None)  # tiers that index in the background
                if ready is not None:
                    assert self.loop.run_until_complete(ready(60)), "tier index never became ready"
                self.model: dict[bytes, bytes] = {}

            def run(self, coro):
                return self.loop.run_until_complete(coro)

            @rule(i=st.integers(0, 15), seed=st.integers(0, 3), size=st.integers(0, 2))
            def write(self, i: int, seed: int, size: int) -> None:
                k, v = _rec(i, seed, size)
                self.run(self.tier.write(k, memoryview(v)))
                self.model[k] = v

            @rule(i=st.integers(0, 15))
            def read(self, i: int) -> None:
                k = random_key(i)
                expect = self.model.get(k)
                got = self.run(_read(self.tier, k, len(expect) if expect else 4096))
                assert got == expect

            @rule(i=st.integers(0, 15), start=st.integers(0, 20000), length=st.integers(1, 9000))
            def read_range(self, i: int, start: int, length: int) -> None:
                k = random_key(i)
                v = self.model.get(k)
                if v is None or start + length > len(v):
                    return
                got = self.run(_read(self.tier, k, length, ByteRange(start, length)))
                assert got == v[start : start + length]

            @rule(i=st.integers(0, 15))
            def delete(self, i: int) -> None:
                k = random_key(i)
                assert self.run(self.tier.delete(k)) == (k in self.model)
                self.model.pop(k, None)

            @invariant()
            def index_matches_model(self) -> None:
                assert set(self.tier.keys()) == set(self.model)
                assert self.tier.usage().num_blocks == len(self.model)
                for k, v in self.model.items():
                    assert self.tier.size_of(k) == len(v)

            def teardown(self) -> None:
                self.run(self.tier.close())
                self.loop.close()

        TierMachine.TestCase.settings = settings(
            max_examples=20,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        TierMachine.TestCase().runTest()


def random_payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
