"""Hedged ranged GETs (``tiers/objectstore/hedge.py``) on both read paths, through a real TCP
proxy in front of moto (Ceph RGW when marked s3): a GET that has not answered after the p99 of
recent GETs gets an identical twin; the first to answer fills the caller's buffers, the other is
closed (never pooled half-read) and never writes there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from infra.faultproxy import FaultProxy
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.factory import _ObjectReadCollector
from dynamo_tiered_kv.tiers.objectstore import S3Backend
from dynamo_tiered_kv.tiers.objectstore.backend import BackendStats
from dynamo_tiered_kv.tiers.objectstore.hedge import HEDGE_FLOOR_S, Attempt, HedgeLost, Hedger
from dynamo_tiered_kv.tiers.objectstore.latency import MIN_SAMPLES, GetLatency

pytest_plugins = ["infra.fixtures_s3"]
DATA = bytes(range(251)) * 4000  # ~1 MiB, a prime period: a shifted or torn range shows
HANG_GUARD_S = 20
PATHS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "aiobotocore"])


class _ClosingProxy(FaultProxy):
    """Counts the stalled connections the client closed (a stalled one ends only then)."""

    stalled_closed = 0

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self._modes: dict[asyncio.Task, str] = {}

    def _take_mode(self) -> str:
        mode = super()._take_mode()
        task = asyncio.current_task()
        assert task is not None
        self._modes[task] = mode
        return mode

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await super()._handle(reader, writer)
        finally:
            if self._modes.pop(asyncio.current_task(), None) == "stall":  # type: ignore[arg-type]
                self.stalled_closed += 1


@pytest.fixture
async def proxy(server: S3Server) -> AsyncIterator[_ClosingProxy]:
    host, port = server.endpoint.rsplit("//", 1)[1].split(":")
    p = await _ClosingProxy(host, int(port)).start()
    yield p
    await p.stop()


async def _read(b: S3Backend, offset: int, sizes: list[int]) -> bytes:
    bufs = [bytearray(n) for n in sizes]
    got = await asyncio.wait_for(b.get_range("o", offset, [memoryview(x) for x in bufs]), HANG_GUARD_S)
    assert got == sum(sizes)
    return b"".join(bufs)


@PATHS
async def test_a_late_get_is_hedged_and_the_twin_that_answers_is_used(
        server: S3Server, proxy: _ClosingProxy, direct: bool) -> None:
    b = S3Backend(unique_bucket("hedge"), "h/", **{**server.backend_kwargs(), "endpoint_url": proxy.endpoint},
                  direct_reads=direct, first_byte_timeout_s=5.0)  # type: ignore[arg-type]
    await b.open()
    await b.put_object("o", DATA)
    for i in range(MIN_SAMPLES):  # the window learns what an answer usually takes
        assert await _read(b, i * 1000, [5000]) == DATA[i * 1000:i * 1000 + 5000]
    after = b.hedger.delay()
    assert after is not None and HEDGE_FLOOR_S <= after < 5.0
    assert b.stats.hedges_sent == 0
    proxy.set_mode("stall", count=1)  # the next connection is accepted and never answered
    proxy.sever()  # no pooled connection: the next GET dials, and gets the stall
    await asyncio.sleep(0.1)
    seen = proxy.connections
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    got = await _read(b, 12345, [1, 70000, 300000, 7])
    took = loop.time() - t0
    assert got == DATA[12345:12345 + 370008]  # the whole range, from one response, in order
    assert b.stats.hedges_sent == 1 and b.stats.hedges_won == 1 and b.hedger.in_flight == 0
    assert proxy.faults == 1 and proxy.connections == seen + 2  # the stalled GET and its twin
    assert took < 5.0  # answered by the twin, long before the stalled GET's 5 s first-byte bound
    for _ in range(100):  # the stalled connection was closed by the client (not left open, not pooled)
        if proxy.stalled_closed:
            break
        await asyncio.sleep(0.05)
    assert proxy.stalled_closed == 1
    if direct:
        assert b._direct is not None and all(not c.closed for conns in b._direct._idle.values() for c, _ in conns)
    assert b.stats.failures == 0 and b.stats.retries == 0  # one read, answered: nothing was retried
    samples = _ObjectReadCollector(b).collect()
    assert {m.name: m.samples[0].value for m in samples} == {"dtkv_s3_hedges_sent": 1.0, "dtkv_s3_hedges_won": 1.0}
    await b.close()


async def test_a_read_that_answers_in_time_is_not_hedged(moto_s3: S3Server) -> None:
    b = S3Backend(unique_bucket("nohedge"), **moto_s3.backend_kwargs())
    await b.open()
    await b.put_object("o", DATA)
    for i in range(3 * MIN_SAMPLES):
        assert await _read(b, i, [100]) == DATA[i:i + 100]
    assert b.stats.hedges_sent <= 1  # at most the odd GET later than the window's p99
    assert b.stats.hedges_won <= b.stats.hedges_sent
    await b.close()


async def test_once_one_attempt_owns_the_buffers_the_other_never_writes() -> None:
    """The first attempt is late to answer, so a twin goes out; the twin begins its body first and
    owns the buffers. The first's body then begins too, in a loop callback as a socket protocol's
    does (it runs whether or not its task still waits): it is refused and stores nothing."""
    lat = GetLatency()
    for _ in range(MIN_SAMPLES):
        lat.first_byte(0.01)
    stats = BackendStats()
    hedger = Hedger(lat, stats, max_in_flight=1, first_byte_timeout_s=1.0)
    buf = bytearray(8)
    refused: list[Attempt] = []

    async def read(a: Attempt) -> int:
        loop = asyncio.get_running_loop()
        if not a.hedge:
            done: asyncio.Future[int] = loop.create_future()

            def body_begins() -> None:
                a.first_byte()
                if a.own():
                    buf[:] = b"AAAAAAAA"
                    if not done.done():
                        done.set_result(8)
                    return
                refused.append(a)
                if not done.done():
                    done.set_exception(HedgeLost("refused"))

            loop.call_later(0.3, body_begins)  # after the twin owns the buffers
            return await done
        a.first_byte()
        assert a.own()
        buf[:4] = b"BBBB"
        await asyncio.sleep(0.5)  # the twin's body takes a while; the first's begins meanwhile
        buf[4:] = b"BBBB"
        return 8

    assert await hedger.run(read) == 8
    assert bytes(buf) == b"BBBBBBBB"
    assert len(refused) == 1 and not refused[0].hedge
    assert stats.hedges_sent == 1 and stats.hedges_won == 1 and hedger.in_flight == 0
