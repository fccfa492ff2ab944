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
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ..tiers.base import ByteRange, ReadRequest, Tier, TierExpiry
from .clock import ManualClock
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


class _Hook:
    """Records what a tier reports through ``set_residency_hook``."""

    def __init__(self) -> None:
        self.evicted_keys: list[bytes] = []
        self.flushed_keys: list[bytes] = []

    def evicted(self, keys: Sequence[bytes]) -> None:
        self.evicted_keys.extend(keys)

    def flushed(self, keys: Sequence[bytes]) -> None:
        self.flushed_keys.extend(keys)


async def _ready(tier: Tier, timeout_s: float = 60.0) -> None:
    """Wait until ``tier.index_ready`` (tiers that index in the background)."""
    deadline = time.monotonic() + timeout_s
    while not tier.index_ready:
        assert time.monotonic() < deadline, "tier index never became ready"
        await asyncio.sleep(0.01)


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

    async def test_tenant_usage_counts_each_tenants_records(self, tmp_path: Path) -> None:
        """``tenant_usage`` (where the tier accounts by tenant) counts exactly the bytes and blocks
        of each tenant's records after writes, an overwrite by another tenant, deletes and, for a
        durable tier, a reopen."""
        t = await self.make_tier(tmp_path / "tenants", self.capacity_bytes)
        await t.open()
        if t.tenant_usage() is None:
            await t.close()
            pytest.skip("tier does not account by tenant")
        tenants = [bytes([n]) * 8 for n in (1, 2, 3)]
        model: dict[bytes, tuple[bytes, int]] = {}  # key -> (tenant, record bytes)

        async def write(i: int, tenant: bytes, size_class: int) -> None:
            key = random_key(600 + i)
            rec = make_record(key, i, shape=SHAPES[size_class % len(SHAPES)], tenant=tenant)
            await t.write(key, memoryview(rec))
            model[key] = (tenant, len(rec))

        def expected() -> dict[bytes, tuple[int, int]]:
            out: dict[bytes, tuple[int, int]] = {}
            for tenant, n in model.values():
                b, c = out.get(tenant, (0, 0))
                out[tenant] = (b + n, c + 1)
            return out

        try:
            for i in range(12):
                await write(i, tenants[i % 3], i)
            assert t.tenant_usage() == expected()
            await write(0, tenants[2], 2)  # the key of tenant 1's record now holds tenant 3's
            deleted = {}
            for i in (1, 4, 5):
                assert await t.delete(random_key(600 + i)) is True
                deleted[random_key(600 + i)] = model.pop(random_key(600 + i))
            assert t.tenant_usage() == expected()
            if t.capabilities.durable:
                t = await self.reopen_tier(t, tmp_path / "tenants", self.capacity_bytes)
                if t.capabilities.shared:  # a shared tier's delete stops only this process serving the copy
                    model.update(deleted)
                assert t.tenant_usage() == expected()
        finally:
            await t.close()

    async def test_erase_tenant_drops_exactly_that_tenants_records(self, tier: Tier) -> None:
        """``erase_tenant`` (a cluster-wide erasure applied here) drops every record of the tenant
        and none of another's; the dropped keys are reported as evicted and read as misses."""
        hook = _Hook()
        tier.set_residency_hook(hook)
        gone, kept = bytes([7]) * 8, bytes([8]) * 8
        recs = {}
        for i in range(6):
            key = random_key(700 + i)
            tenant = gone if i % 2 else kept
            recs[key] = (tenant, make_record(key, i, tenant=tenant))
            await tier.write(key, memoryview(recs[key][1]))
        assert await tier.erase_tenant(gone) == 3
        for key, (tenant, rec) in recs.items():
            got = await _read(tier, key, len(rec))
            assert (got is None) if tenant == gone else (got == rec)
        assert sorted(k for k, (t, _) in recs.items() if t == gone) == sorted(set(hook.evicted_keys))
        assert await tier.erase_tenant(gone) == 0

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

    # --- the rest of the contract (tiers/base.py) -------------------------------------------
    async def test_index_ready_after_open(self, tier: Tier) -> None:
        await _ready(tier)
        assert tier.index_ready is True

    async def test_read_shape_attributes_have_declared_types(self, tier: Tier) -> None:
        for name in ("read_parallelism", "read_piece_bytes", "frugal_piece_bytes", "load_chunk_bytes"):
            v = getattr(tier, name)
            assert v is None or (type(v) is int and v > 0), (name, v)
        assert type(tier.max_concurrency) is int and tier.max_concurrency >= 1
        assert type(tier.slab_reads_now) is bool
        assert type(tier.reads_in_place) is bool
        assert type(tier.index_ready) is bool

    async def test_device_io_is_none_without_a_gpu(self, tier: Tier) -> None:
        assert tier.device_io is None

    async def test_read_paths_agree(self, tier: Tier) -> None:
        """``read_many``, ``read_into``, ``read_slab`` and ``read_slab_now`` return the same bytes."""
        await _ready(tier)
        items = [_rec(600 + i, size_class=1) for i in range(5)]
        odd_key, odd = _rec(610, size_class=2)  # another length: a miss for read_slab
        await tier.write_many([(k, memoryview(v)) for k, v in items] + [(odd_key, memoryview(odd))])
        rb = len(items[0][1])
        bufs = [bytearray(rb) for _ in items]
        got = await tier.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(items, bufs)])
        assert got == [rb] * len(items) and [bytes(b) for b in bufs] == [v for _, v in items]
        for k, v in items:
            assert await _read(tier, k, rb) == v
        keys = [k for k, _ in items] + [odd_key, random_key(654_321)]
        slab = np.zeros(len(keys) * rb, dtype=np.uint8)
        got = await tier.read_slab(keys, slab, rb)
        assert got == [rb] * len(items) + [None, None]
        assert [slab[i * rb:(i + 1) * rb].tobytes() for i in range(len(items))] == [v for _, v in items]
        now = np.zeros_like(slab)
        direct = tier.read_slab_now(keys, now, rb)
        if tier.slab_reads_now:
            assert direct == got and now[:len(items) * rb].tobytes() == slab[:len(items) * rb].tobytes()
        else:
            assert direct is None
        for start, length in ((0, 4096), (4096, 4096), (rb - 4096, 4096), (100, 1)):
            b1, b2 = bytearray(length), bytearray(length)
            rng = ByteRange(start, length)
            n1 = (await tier.read_many([ReadRequest(items[1][0], memoryview(b1), rng)]))[0]
            n2 = await tier.read_into(items[1][0], memoryview(b2), rng)
            assert n1 == n2 == length and bytes(b1) == bytes(b2) == items[1][1][start:start + length]

    async def test_split_reads_lay_each_record_over_its_parts(self, tier: Tier) -> None:
        """``read_split`` (and ``read_split_now`` where ``split_reads_now``) lays each whole record,
        in order, over the caller's parts; an absent key or another length is None."""
        await _ready(tier)
        items = [_rec(620 + i) for i in range(4)]
        odd_key, odd = _rec(630, size_class=2)
        await tier.write_many([(k, memoryview(v)) for k, v in items] + [(odd_key, memoryview(odd))])
        rb = len(items[0][1])
        keys = [k for k, _ in items[:2]] + [random_key(654_322), odd_key, *[k for k, _ in items[2:]]]
        cuts = (64, rb - 64 - 100)  # a header-sized part, the payload, a tail

        def parts() -> list[list[np.ndarray]]:
            return [[np.zeros(cuts[0], np.uint8), np.zeros(cuts[1], np.uint8), np.zeros(rb - sum(cuts), np.uint8)]
                    for _ in keys]

        want = [v for _, v in items[:2]] + [None, None] + [v for _, v in items[2:]]
        for now in (False, True):
            if now and not tier.split_reads_now:
                assert tier.read_split_now(keys, parts(), rb) is None
                continue
            ps = parts()
            got = tier.read_split_now(keys, ps, rb) if now else await tier.read_split(keys, ps, rb)
            assert got == [None if w is None else rb for w in want]
            for w, own in zip(want, ps):
                if w is not None:
                    assert b"".join(p.tobytes() for p in own) == w
        with pytest.raises(ValueError):
            await tier.read_split(keys[:1], [[np.zeros(rb - 1, np.uint8)]], rb)

    async def test_records_read_in_place_match_the_stored_bytes(self, tier: Tier) -> None:
        """Where ``reads_in_place``, ``pin_records`` shows the leading present records' bytes (a copy
        only through ``spill``); elsewhere it refuses."""
        await _ready(tier)
        items = [_rec(700 + i) for i in range(3)]
        await tier.write_many([(k, memoryview(v)) for k, v in items])
        rb = len(items[0][1])
        spill = np.zeros(len(items) * rb, dtype=np.uint8)
        keys = [k for k, _ in items[:2]] + [random_key(777_777), items[2][0]]
        if not tier.reads_in_place:
            with pytest.raises(NotImplementedError):
                tier.pin_records(keys, lambda j: spill[j * rb:(j + 1) * rb])
            return
        views, pin = tier.pin_records(keys, lambda j: spill[j * rb:(j + 1) * rb])
        try:
            assert [v.tobytes() for v in views] == [v for _, v in items[:2]]  # stops at the absent key
        finally:
            pin.release()
            pin.release()  # idempotent

    async def test_seal_is_idempotent_and_keeps_records_readable(self, tier: Tier) -> None:
        items = [_rec(700 + i, size_class=i) for i in range(3)]
        await tier.write_many((k, memoryview(v)) for k, v in items)
        await tier.seal()
        await tier.seal()
        for k, v in items:
            assert await _read(tier, k, len(v)) == v
        k, v = _rec(710)
        await tier.write(k, memoryview(v))  # writes go on after a seal
        await tier.seal()
        assert await _read(tier, k, len(v)) == v

    async def test_configure_retention_returns_the_table_the_tier_uses(self, tier: Tier) -> None:
        clock = ManualClock()
        cls = tier.configure_retention(max_share=0.5, clock=clock)
        assert tier.retention is cls and cls.clock is clock

    async def test_expire_drops_exactly_the_expired_retained_blocks(self, tier: Tier) -> None:
        await _ready(tier)
        clock = ManualClock()
        cls = tier.configure_retention(max_share=1.0, clock=clock)
        (ek, ev), (pk, pv), (ok, ov), (lk, lv) = (_rec(800 + i) for i in range(4))
        await tier.write_many([(ek, memoryview(ev)), (pk, memoryview(pv)), (ok, memoryview(ov)),
                               (lk, memoryview(lv))])
        cls.set(ek, 50, clock.t + 10, len(ev))  # expires in 10 s
        cls.set(pk, 50, None, len(pv))  # protected for good
        cls.set(lk, 50, clock.t + 1000, len(lv))  # protected, expiry later
        hook = _Hook()
        tier.set_residency_hook(hook)
        assert await tier.expire(clock.t, 1 << 30) == TierExpiry(0, 0)  # nothing expired yet
        clock.t += 20
        done = await tier.expire(clock.t, 1 << 30)
        assert done == TierExpiry(1, len(ev))
        assert not tier.contains(ek) and await _read(tier, ek, len(ev)) is None
        for k, v in ((pk, pv), (ok, ov), (lk, lv)):
            assert await _read(tier, k, len(v)) == v
        assert await tier.expire(clock.t, 1 << 30) == TierExpiry(0, 0)  # a second pass finds nothing

    def _pressure_capacity(self) -> tuple[int, int]:
        """(record length, a capacity of several records): 64 KiB at least per record, the
        allocation unit of a chunked tier."""
        rec_len = len(_rec(0, size_class=2)[1])
        return rec_len, 8 * max(rec_len, 64 << 10)

    async def _pressure_tier(self, tmp_path: Path, name: str) -> Tier:
        _, cap = self._pressure_capacity()
        t = await self.make_tier(tmp_path / name, cap)
        await t.open()
        await _ready(t)
        return t

    async def test_eviction_keeps_retained_blocks_and_drops_ordinary_ones(self, tmp_path: Path) -> None:
        """A retained block survives a flood of ordinary writes; an ordinary block written before it
        does not; the residency hook hears every block the tier dropped on its own."""
        t = await self._pressure_tier(tmp_path, "retain")
        try:
            clock = ManualClock()
            cls = t.configure_retention(max_share=0.5, clock=clock)
            hook = _Hook()
            t.set_residency_hook(hook)
            (uk, uv), (rk, rv) = _rec(900, size_class=2), _rec(901, size_class=2)
            await t.write(uk, memoryview(uv))
            await t.seal()  # apart from the retained one (an SSD tier evicts whole segments)
            cls.set(rk, 50, None, len(rv))
            await t.write(rk, memoryview(rv))
            await t.seal()
            rec_len, cap = self._pressure_capacity()
            flood = [_rec(10_000 + i, size_class=2) for i in range(2 * cap // rec_len + 4)]
            for k, v in flood:
                await t.write(k, memoryview(v))
            await self._settle(t)
            assert await _read(t, rk, len(rv)) == rv
            assert not t.contains(uk)
            dropped = {k for k, _ in [(uk, uv), *flood] if not t.contains(k)}
            assert dropped and dropped <= set(hook.evicted_keys)
            assert rk not in hook.evicted_keys
        finally:
            await t.close()

    async def test_eviction_takes_expired_blocks_first(self, tmp_path: Path) -> None:
        """Among evictable blocks, one whose retention expired goes before older ordinary ones."""
        t = await self._pressure_tier(tmp_path, "expired")
        try:
            clock = ManualClock()
            cls = t.configure_retention(max_share=0.5, clock=clock)
            ordinary = [_rec(950 + i, size_class=2) for i in range(2)]
            for k, v in ordinary:
                await t.write(k, memoryview(v))
            await t.seal()
            ek, ev = _rec(960, size_class=2)
            cls.set(ek, 50, clock.t + 10, len(ev))
            await t.write(ek, memoryview(ev))
            await t.seal()
            clock.t += 20  # its retention is over: it is the first victim now
            rec_len, cap = self._pressure_capacity()
            fill = [_rec(20_000 + i, size_class=2) for i in range(2 * cap // rec_len + 4)]
            for k, v in fill:
                await t.write(k, memoryview(v))
                await t.seal()
                if not t.contains(ek):
                    break
            await self._settle(t)
            assert not t.contains(ek)
            assert all(t.contains(k) for k, _ in ordinary)  # the older ordinary blocks stayed
        finally:
            await t.close()

    async def _settle(self, tier: Tier) -> None:
        """Hook for tiers that enforce capacity in the background (none here: a no-op)."""

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
                self.loop.run_until_complete(_ready(self.tier))
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
