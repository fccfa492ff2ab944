"""The first-byte bound of a ranged GET (``first_byte_timeout_s``), on both read paths (the direct
reader and aiobotocore), through a real TCP proxy in front of moto (Ceph RGW when marked s3).

A bucket that accepts requests and never answers them (a stalled gateway, an overloaded HDD
pool) costs each attempt about the bound, not the read's whole budget; a response that has begun
is bounded by the body idle timeout instead, however long it takes in all.
"""

from __future__ import annotations

import asyncio

import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.objectstore import ObjectTier, RetryPolicy, S3Backend
from dynamo_tiered_kv.tiers.objectstore.stalls import STALL_WAITS

pytest_plugins = ["infra.fixtures_s3"]
HANG_GUARD_S = 20  # past this the read waited for its whole budget (30 s)
PATHS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "aiobotocore"])



async def _backend(server: S3Server, proxy: FaultProxy, **kw: object) -> S3Backend:
    bucket = unique_bucket("fb")
    b = S3Backend(bucket, "f/", **{**server.backend_kwargs(), "endpoint_url": proxy.endpoint}, **kw)  # type: ignore[arg-type]
    await b.open()
    return b


@PATHS
async def test_a_stalled_bucket_fails_a_restore_in_seconds_not_at_its_deadline(
        server: S3Server, proxy: FaultProxy, direct: bool) -> None:
    """Defaults everywhere (a 30 s read budget, four attempts): every GET is accepted and never
    answered. The read misses after its first-byte allowance (two bounds: one retry), far from the
    30 s budget."""
    backend = await _backend(server, proxy, direct_reads=direct)
    tier = ObjectTier(backend, read_timeout_s=30)
    await tier.open()
    assert await tier.wait_ready(30)
    shape = small_shape(num_layers=8)
    recs = [(random_key(i, b"fb"), make_record(random_key(i, b"fb"), i, shape=shape)) for i in range(4)]
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    proxy.set_mode("stall")
    proxy.sever()
    bufs = [bytearray(len(v)) for _, v in recs]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TierUnavailable):
        await asyncio.wait_for(tier.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(recs, bufs)]),
                               HANG_GUARD_S)
    took = loop.time() - t0
    assert took < STALL_WAITS * backend.first_byte_timeout_s + 6.0, took  # two waits, a backoff, a loaded box
    assert backend.stats.failures == 1 and backend.stats.retries == 1  # no third wait on a stalled gateway
    assert proxy.faults >= 2
    proxy.set_mode("pass")
    assert await tier.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(recs, bufs)]) == \
        [len(v) for _, v in recs]
    assert [bytes(b) for b in bufs] == [v for _, v in recs]
    await tier.close()


@PATHS
async def test_the_bound_is_its_own_and_is_recorded_as_a_lower_bound(
        server: S3Server, proxy: FaultProxy, direct: bool) -> None:
    """One attempt (no retries, no shared deadline): the stalled GET fails after the first-byte
    bound with the first-byte error, well before read_timeout_s, and the window keeps the wait."""
    backend = await _backend(server, proxy, direct_reads=direct, retry=RetryPolicy(max_attempts=1),
                             read_timeout_s=60, first_byte_timeout_s=0.5)
    await backend.put_object("o", b"x" * 100_000)
    proxy.set_mode("stall")
    proxy.sever()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TierUnavailable, match="FirstByteTimeout"):
        await asyncio.wait_for(backend.get_range("o", 0, [memoryview(bytearray(50_000))]), HANG_GUARD_S)
    assert 0.45 <= loop.time() - t0 < 0.5 + 5.0
    assert len(backend.latency) == 1 and backend.latency._first[0] >= 0.45
    assert backend.stats.direct_fallbacks == 0
    await backend.close()


@PATHS
async def test_a_slow_body_that_has_begun_is_not_cut_by_the_first_byte_bound(
        server: S3Server, proxy: FaultProxy, direct: bool) -> None:
    """Every chunk from the server arrives 0.2 s late: the first byte within the 0.5 s bound, the
    whole body in far more than that. The read succeeds: silence, not duration, fails a body."""
    data = bytes(range(256)) * 2048  # 512 KiB: several chunks through the proxy
    backend = await _backend(server, proxy, direct_reads=direct, retry=RetryPolicy(max_attempts=1),
                             first_byte_timeout_s=0.5, hedge_reads=False)
    await backend.put_object("o", data)
    proxy.delay_s = 0.2
    proxy.set_mode("delay")
    proxy.sever()
    buf = bytearray(len(data))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await asyncio.wait_for(backend.get_range("o", 0, [memoryview(buf)]), HANG_GUARD_S) == len(data)
    assert bytes(buf) == data
    assert loop.time() - t0 > 0.5  # it did outlast the first-byte bound
    await backend.close()
