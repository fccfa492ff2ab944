"""Fault injection between the object tier and a real S3 server (moto; Ceph RGW when marked s3).

Whatever the proxy does (503 SlowDown, resets, drops, stalls, cut or corrupted bodies, a server
dying mid-upload): sealed data is never lost, wrong bytes are never served, and every call
returns or raises ``TierUnavailable`` within its bounded timeouts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, unique_bucket
from infra.segments_fake import FakeSegmentSource

from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.objectstore import ObjectTier, RetryPolicy, S3Backend
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher

pytest_plugins = ["infra.fixtures_s3"]
HANG_GUARD_S = 30  # a call still running after this is a hang (the bounds below are ~1-3 s)
FAST = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05, attempt_timeout_s=1.0)



async def _tier(server: S3Server, proxy: FaultProxy, **kw: object) -> ObjectTier:
    bucket = unique_bucket("fault")
    direct = S3Backend(bucket, **server.backend_kwargs())
    await direct.open()  # bucket created without faults
    await direct.close()
    opts = {"retry": FAST, "breaker_threshold": 1000, "breaker_cooldown_s": 0.5, **kw}
    backend = S3Backend(bucket, "f/", **{**server.backend_kwargs(), "endpoint_url": proxy.endpoint,
                                         "create_bucket": False}, **opts)  # type: ignore[arg-type]
    tier = ObjectTier(backend, read_timeout_s=10)
    await tier.open()
    await tier.wait_ready(30)  # open() returns at once; the index builds in the background
    return tier


def _recs(n: int, layers: int = 4, base: int = 0) -> list[tuple[bytes, bytes]]:
    shape = small_shape(num_layers=layers)
    return [(random_key(base + i, b"f"), make_record(random_key(base + i, b"f"), base + i, shape=shape))
            for i in range(n)]


async def _read_all(tier: ObjectTier, recs: list[tuple[bytes, bytes]]) -> list[bytes | None]:
    bufs = [bytearray(len(v)) for _, v in recs]
    got = await asyncio.wait_for(
        tier.read_many([ReadRequest(k, memoryview(b)) for (k, _), b in zip(recs, bufs)]), HANG_GUARD_S)
    return [None if n is None else bytes(b) for n, b in zip(got, bufs)]


@pytest.mark.parametrize("mode", ["http503", "reset", "drop", "truncate"])
async def test_transient_faults_are_retried(server: S3Server, proxy: FaultProxy, mode: str) -> None:
    tier = await _tier(server, proxy)
    recs = _recs(6)
    proxy.truncate_after = 2000
    proxy.set_mode(mode, count=2)  # the next two connections fail, then the server is fine
    proxy.sever()  # RGW keeps connections alive: make the client dial again
    await asyncio.wait_for(tier.write_many((k, memoryview(v)) for k, v in recs), HANG_GUARD_S)
    proxy.set_mode(mode, count=1)
    await tier.close()
    tier2 = await _tier_reopen(tier, proxy)
    assert await _read_all(tier2, recs) == [v for _, v in recs]
    assert proxy.faults >= 2
    if mode == "http503":  # (aiohttp itself may silently retry a reset keep-alive connection)
        assert tier.backend.stats.retries + tier2.backend.stats.retries >= 1
    await tier2.close()


async def _tier_reopen(tier: ObjectTier, proxy: FaultProxy) -> ObjectTier:
    b = tier.backend
    assert isinstance(b, S3Backend)
    nb = S3Backend(b.bucket, b.prefix, endpoint_url=proxy.endpoint, access_key=b._access_key,
                   secret_key=b._secret_key, retry=FAST, breaker_threshold=1000)
    t = ObjectTier(nb, read_timeout_s=10)
    await t.open()
    await t.wait_ready(30)  # open() returns at once; the index builds in the background
    return t


async def test_corrupted_bytes_in_flight_are_never_served(server: S3Server, proxy: FaultProxy) -> None:
    tier = await _tier(server, proxy)
    recs = _recs(4)
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    proxy.corrupt_offset = len(recs[0][1]) + 6000  # inside the second record's payload
    proxy.set_mode("corrupt")
    proxy.sever()
    got = await _read_all(tier, recs)
    # detected by the record checksum; the re-read of that one record (a shorter body the proxy
    # leaves intact) verifies, so it is served: a bit flipped in transit costs one GET, no data
    assert got == [v for _, v in recs]
    assert tier.stats.reread_ok == 1 and tier.stats.corrupt_reads == 0
    proxy.corrupt_offset = 6000  # now every read of record 0 is damaged: a miss, never served
    proxy.sever()  # the offset applies to new connections
    got = await _read_all(tier, recs[:1])
    assert got == [None] and tier.stats.corrupt_reads == 1 and not tier.contains(recs[0][0])
    await tier.close()


@pytest.mark.parametrize("mode", ["reset_body", "stall_body"])
async def test_connection_cut_mid_body_misses_within_the_retry_budget(server: S3Server, proxy: FaultProxy,
                                                                     mode: str) -> None:
    """A ranged GET whose connection is cut in the middle of the body (the RST arrives, or never
    does) fails over in seconds with the default policy, not after read_timeout_s (30 s)."""
    bucket = unique_bucket("midbody")
    backend = S3Backend(bucket, "m/", **{**server.backend_kwargs(), "endpoint_url": proxy.endpoint})
    tier = ObjectTier(backend)  # defaults: RetryPolicy(), read_timeout_s=30
    await tier.open()
    await tier.wait_ready(30)  # open() returns at once; the index builds in the background
    recs = _recs(4, layers=16)  # ~70 KiB records: one ~280 KiB GET
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    proxy.body_after = 20_000
    proxy.set_mode(mode)
    proxy.sever()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        got: list[bytes | None] = await _read_all(tier, recs)
    except TierUnavailable:
        got = [None] * len(recs)
    took = loop.time() - t0
    assert got == [None] * len(recs)  # a miss, never partial bytes
    assert took < 12.0, f"{mode}: the load took {took:.1f} s to miss (read_timeout_s is {tier.read_timeout_s})"
    assert proxy.faults >= 1
    proxy.set_mode("pass")
    proxy.sever()
    assert await _read_all(tier, recs) == [v for _, v in recs]  # and the next load is served
    await tier.close()


async def test_stalled_server_times_out_and_index_stays_responsive(server: S3Server, proxy: FaultProxy) -> None:
    tier = await _tier(server, proxy)
    recs = _recs(2)
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    proxy.set_mode("stall")
    proxy.sever()
    read = asyncio.ensure_future(_read_all(tier, recs))
    await asyncio.sleep(0.1)
    assert not read.done()
    # Engine-facing lookups are memory-only: they answer while the read hangs on the network.
    assert tier.contains(recs[0][0]) and tier.size_of(recs[1][0]) == len(recs[1][1])
    assert tier.contains_prefix([k for k, _ in recs]) == 2
    with pytest.raises(TierUnavailable):
        await read
    await tier.close()


async def test_breaker_opens_on_dead_endpoint_and_probes_later(server: S3Server, proxy: FaultProxy) -> None:
    tier = await _tier(server, proxy, breaker_threshold=2, breaker_cooldown_s=0.3)
    recs = _recs(2)
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    proxy.set_mode("reset")  # the server is gone
    proxy.sever()
    for _ in range(2):
        with pytest.raises(TierUnavailable):
            await _read_all(tier, recs)
    backend = tier.backend
    assert isinstance(backend, S3Backend) and backend.breaker.state == "open"
    seen = proxy.connections
    with pytest.raises(TierUnavailable, match="circuit breaker"):
        await _read_all(tier, recs)
    assert proxy.connections == seen  # an open breaker does not touch the network
    proxy.set_mode("pass")  # the server is back
    await asyncio.sleep(0.35)
    assert backend.breaker.state == "half-open"
    assert await _read_all(tier, recs) == [v for _, v in recs]  # the probe succeeds
    assert backend.breaker.state == "closed" and backend.breaker.opened_count == 1
    await tier.close()


async def test_server_dying_mid_upload_loses_no_sealed_data(tmp_path: Path, server: S3Server,
                                                            proxy: FaultProxy) -> None:
    src = FakeSegmentSource(tmp_path / "ssd")
    made = [src.add_segment(45, seed=50 + i, num_layers=32) for i in range(2)]  # ~6 MiB each: multipart
    tier = await _tier(server, proxy, part_bytes=5 << 20)
    proxy.delay_s = 0.3
    proxy.set_mode("delay")
    fl = Flusher(src, tier, scan_interval_s=0.05, retry_base_s=0.05, retry_max_s=0.2)
    await fl.start()
    try:
        for _ in range(200):
            if proxy.connections >= 2:
                break
            await asyncio.sleep(0.02)
        proxy.set_mode("reset")
        proxy.sever()  # the server dies with uploads in flight
        for _ in range(300):
            if fl.stats.failures:
                break
            await asyncio.sleep(0.02)
        assert fl.stats.failures >= 1
        assert src.unflushed_segments()  # nothing was marked flushed that is not stored
        proxy.set_mode("pass")
        assert await fl.drain(timeout=HANG_GUARD_S)
    finally:
        await fl.stop()
    fresh = await _tier_reopen(tier, proxy)
    for seg, recs in made:
        bufs = [bytearray(e.length) for e in seg.entries]
        got = await fresh.read_many([ReadRequest(e.key, memoryview(b)) for e, b in zip(seg.entries, bufs)])
        assert got == [len(r) for r in recs] and [bytes(b) for b in bufs] == recs
    await tier.close()
    await fresh.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "aiobotocore"])
@pytest.mark.parametrize("mode", ["reset_half", "stall_half"])
async def test_a_response_cut_in_its_first_segment_misses_well_before_the_deadline(
        server: S3Server, proxy: FaultProxy, mode: str, direct: bool) -> None:
    """For 6 s every GET gets half of the server's first segment (cut inside the headers), then
    the connection is reset, or the reset never reaches the client. The load ends long before
    read_timeout_s (a miss, or a hit once the fault is over), not at the deadline."""
    bucket = unique_bucket("halfseg")
    backend = S3Backend(bucket, "h/", **{**server.backend_kwargs(), "endpoint_url": proxy.endpoint},
                        direct_reads=direct)
    tier = ObjectTier(backend, read_timeout_s=30)  # defaults otherwise: RetryPolicy(), 30 s headers wait
    await tier.open()
    await tier.wait_ready(30)
    recs = _recs(4, layers=16)
    await tier.write_many((k, memoryview(v)) for k, v in recs)
    proxy.half_max = 100  # the status line and part of the headers
    proxy.set_mode(mode, for_s=6.0)
    proxy.sever()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        got = await _read_all(tier, recs)
    except TierUnavailable:
        got = [None] * len(recs)
    took = loop.time() - t0
    assert got in ([None] * len(recs), [v for _, v in recs])  # a miss or every record, never partial bytes
    assert took < tier.read_timeout_s / 2, f"{mode}: the load took {took:.1f} s (deadline {tier.read_timeout_s} s)"
    assert proxy.faults >= 1
    proxy.set_mode("pass")
    proxy.sever()
    assert await _read_all(tier, recs) == [v for _, v in recs]
    await tier.close()


async def test_direct_get_cut_inside_the_headers_fails_after_the_idle_timeout(server: S3Server,
                                                                            proxy: FaultProxy) -> None:
    """A response that stops inside its headers, its reset lost, fails its attempt after
    body_idle_timeout_s, not after read_timeout_s (the wait for a response's first byte)."""
    bucket = unique_bucket("halfhead")
    one = RetryPolicy(max_attempts=1)  # no retries and no shared deadline: the reader's own bounds
    backend = S3Backend(bucket, "h/", **{**server.backend_kwargs(), "endpoint_url": proxy.endpoint},
                        retry=one, read_timeout_s=60, body_idle_timeout_s=1.0)
    await backend.open()
    await backend.put_object("o", b"x" * 100_000)
    proxy.half_max = 100
    proxy.set_mode("stall_half")
    proxy.sever()
    buf = bytearray(50_000)
    with pytest.raises(TierUnavailable, match="BodyStalled") as err:
        await asyncio.wait_for(backend.get_range("o", 0, [memoryview(buf)]), HANG_GUARD_S / 2)
    assert "into the response" in str(err.value)
    assert backend.stats.direct_fallbacks == 0
    proxy.set_mode("pass")
    proxy.sever()
    assert await backend.get_range("o", 0, [memoryview(buf)]) == len(buf) and bytes(buf) == b"x" * 50_000
    await backend.close()
