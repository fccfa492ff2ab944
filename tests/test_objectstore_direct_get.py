"""Ranged GETs received straight into the caller's buffers (``direct_get.DirectRangeReader``):
against moto through ``S3Backend`` (Ceph RGW runs the same path in the conformance and fault
tests), and against a scripted HTTP server for what a real one rarely does on cue: fragments,
error documents, a closed keep-alive connection, a stall, framing this reader does not speak."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from botocore.exceptions import ClientError
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.tiers.objectstore import S3Backend
from dynamo_tiered_kv.tiers.objectstore import direct_get as dg
from dynamo_tiered_kv.tiers.objectstore.s3 import is_transient

pytest_plugins = ["infra.fixtures_s3"]
DATA = bytes(range(256)) * 4096  # 1 MiB


def _views(sizes: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    bufs = [bytearray(n) for n in sizes]
    return bufs, [memoryview(b) for b in bufs]


@pytest.fixture(params=["moto_s3", pytest.param("ceph_s3", marks=pytest.mark.s3)])
def server(request: pytest.FixtureRequest) -> S3Server:
    return request.getfixturevalue(request.param)


async def test_backend_reads_ranges_directly(server: S3Server) -> None:
    b = S3Backend(unique_bucket("direct"), "d/", **server.backend_kwargs())
    await b.open()
    try:
        await b.put_object("obj", DATA)
        for offset, sizes in ((0, [4096]), (12345, [1, 70000, 3]), (len(DATA) - 9000, [9000])):
            bufs, views = _views(sizes)
            assert await b.get_range("obj", offset, views) == sum(sizes)
            assert b"".join(bufs) == DATA[offset:offset + sum(sizes)]
        assert await b.get_range("missing", 0, _views([10])[1]) is None
        assert await b.get_range("obj", len(DATA) - 10, _views([20])[1]) is None  # past the end
        assert await b.get_range("obj", len(DATA) + 10, _views([20])[1]) is None  # beyond it
        assert b.stats.direct_gets == 6 and b.stats.direct_fallbacks == 0
        assert b._direct is not None
        if server.kind == "ceph":  # RGW keeps connections alive (moto's server closes each one)
            assert b._direct.connections < 6
    finally:
        await b.close()


async def test_backend_falls_back_to_aiobotocore_for_good(moto_s3: S3Server, monkeypatch) -> None:
    async def unsupported(*a: object) -> int:
        raise dg.DirectGetUnsupported("test: chunked")

    b = S3Backend(unique_bucket("fallback"), **moto_s3.backend_kwargs())
    await b.open()
    try:
        await b.put_object("obj", DATA)
        assert b._direct is not None
        monkeypatch.setattr(b._direct, "get_range", unsupported)
        for _ in range(2):
            bufs, views = _views([5000])
            assert await b.get_range("obj", 100, views) == 5000
            assert bytes(bufs[0]) == DATA[100:5100]
        assert b._direct is None and b.stats.direct_fallbacks == 1 and b.stats.direct_gets == 0
    finally:
        await b.close()
    off = S3Backend(unique_bucket("off"), direct_reads=False, **moto_s3.backend_kwargs())
    await off.open()
    assert off._direct is None
    await off.close()


# --- a scripted server ---------------------------------------------------------------------------
Reply = Callable[[bytes, int], AsyncIterator[bytes | float | None]]  # request, n -> chunks, pauses, close


class Scripted:
    """HTTP on loopback: every request goes to ``reply(request_head, n)``, which yields bytes to
    send, floats to pause for, or None to close the connection."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[bytes] = []
        self.connections = 0

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                async for item in self.reply(head, len(self.requests)):
                    if item is None:
                        w.close()
                        return
                    if isinstance(item, float):
                        await asyncio.sleep(item)
                    else:
                        w.write(item)
                        await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()


class Presigner:
    """The one client call the reader makes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.calls = 0

    async def generate_presigned_url(self, op: str, Params: dict, ExpiresIn: int) -> str:
        self.calls += 1
        return f"http://127.0.0.1:{self.port}/{Params['Bucket']}/{Params['Key']}?X-Amz-Signature=s{self.calls}"


def _range(head: bytes) -> tuple[int, int]:
    line = next(x for x in head.split(b"\r\n") if x.lower().startswith(b"range:"))
    a, b = line.split(b"=")[1].split(b"-")
    return int(a), int(b)


def _partial(head: bytes, extra: str = "") -> bytes:
    a, b = _range(head)
    return (f"HTTP/1.1 206 Partial Content\r\nContent-Length: {b - a + 1}\r\nContent-Range: bytes {a}-{b}/"
            f"{len(DATA)}\r\n{extra}\r\n").encode() + DATA[a:b + 1]


def _error(status: int, code: str) -> bytes:
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m {code}</Message></Error>".encode()
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def _read_each(rd: dg.DirectRangeReader, offsets: tuple[int, ...], n: int) -> None:
    """Each ``[off, off + n)`` read whole and equal to the object's bytes."""
    for off in offsets:
        bufs, views = _views([n])
        assert await rd.get_range("k", off, views) == n and bytes(bufs[0]) == DATA[off:off + n]


def _reader(port: int, **kw: float) -> dg.DirectRangeReader:
    opts = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "body_idle_timeout_s": 0.3, **kw}
    return dg.DirectRangeReader(Presigner(port), "bkt", **opts)


async def test_fragmented_responses_and_keep_alive() -> None:
    async def reply(head: bytes, n: int):
        raw = _partial(head)
        step = 1 if n == 1 else 7919  # byte by byte, then in odd pieces across the header's end
        for i in range(0, len(raw), step):
            yield raw[i:i + step]

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        for offset, sizes in ((3, [10, 1, 5]), (1000, [65536, 3, 200000])):
            bufs, views = _views(sizes)
            assert await rd.get_range("k", offset, views) == sum(sizes)
            assert b"".join(bufs) == DATA[offset:offset + sum(sizes)]
        assert srv.connections == 1 and rd.connections == 1
        assert b"Host: 127.0.0.1:" in srv.requests[0] and b"X-Amz-Signature=s1" in srv.requests[0]
        assert rd._client.calls == 1  # the presigned URL is reused
        await rd.close()


async def test_error_documents_become_client_errors() -> None:
    codes = {1: (503, "SlowDown"), 2: (404, "NoSuchKey"), 3: (416, "InvalidRange"), 4: (403, "AccessDenied"),
             5: (403, "AccessDenied")}

    async def reply(head: bytes, n: int):
        if n in codes:
            yield _error(*codes[n])
        else:
            yield _partial(head)

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        with pytest.raises(ClientError) as e:
            await rd.get_range("k", 0, _views([100])[1])
        assert e.value.response["Error"]["Code"] == "SlowDown" and is_transient(e.value)
        assert await rd.get_range("k", 0, _views([100])[1]) is None  # 404
        assert await rd.get_range("k", 0, _views([100])[1]) is None  # 416
        with pytest.raises(ClientError) as e:  # 403 on the cached URL, signed again, 403 again
            await rd.get_range("k", 0, _views([100])[1])
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403 and not is_transient(e.value)
        assert rd._client.calls == 2
        bufs, views = _views([100])
        assert await rd.get_range("k", 50, views) == 100 and bytes(bufs[0]) == DATA[50:150]
        assert rd._client.calls == 3  # the cache was dropped after the 403
        assert srv.connections == 1  # error documents were read whole: the connection stayed usable
        await rd.close()


async def test_an_expired_signature_is_renewed_once_within_the_read() -> None:
    async def reply(head: bytes, n: int):
        if b"X-Amz-Signature=s1" in head and n > 1:  # the token behind the cached URL expired
            yield _error(400, "ExpiredToken")
        else:
            yield _partial(head)

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        await _read_each(rd, (0, 100), 100)
        assert rd._client.calls == 2 and len(srv.requests) == 3
        await rd.close()


async def test_a_keep_alive_connection_the_server_closed_is_redialed_at_once() -> None:
    async def reply(head: bytes, n: int):
        if n == 2:
            yield None  # the idle connection is closed as the next request arrives: no answer
        else:
            yield _partial(head)

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        await _read_each(rd, (0, 10), 64)
        assert srv.connections == 2 and len(srv.requests) == 3
        await rd.close()


async def test_ranges_past_the_end_and_empty_views() -> None:
    async def reply(head: bytes, n: int):
        a, b = _range(head)
        b = min(b, 999)  # a 1000-byte object
        yield (f"HTTP/1.1 206 P\r\nContent-Length: {b - a + 1}\r\nContent-Range: bytes {a}-{b}/1000\r\n\r\n"
               ).encode() + DATA[a:b + 1]

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        assert await rd.get_range("k", 900, _views([200])[1]) is None  # a miss, at once
        bufs, views = _views([0, 10, 0, 5, 0])
        assert await rd.get_range("k", 20, views) == 15 and b"".join(bufs) == DATA[20:35]
        await rd.close()


async def test_stale_pooled_connections_are_not_reused(monkeypatch) -> None:
    async def reply(head: bytes, n: int):
        yield _partial(head)

    monkeypatch.setattr(dg, "IDLE_MAX_S", 0.0)
    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        await _read_each(rd, (0, 10), 64)
        assert srv.connections == 2
        await rd.close()


async def test_a_cancelled_read_stops_writing_into_its_buffers() -> None:
    async def reply(head: bytes, n: int):
        raw = _partial(head)
        yield raw[:3000]
        yield 0.3
        yield raw[3000:]

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        bufs, views = _views([20000])
        task = asyncio.ensure_future(rd.get_range("k", 0, views))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snapshot = bytes(bufs[0])
        await asyncio.sleep(0.5)  # the rest of the body was sent meanwhile
        assert bytes(bufs[0]) == snapshot and snapshot[-1000:] == bytes(1000)
        assert await rd.get_range("k", 5, _views([10])[1]) == 10  # on a new connection
        await rd.close()


async def test_cut_and_stalled_bodies_fail_fast_and_never_look_complete() -> None:
    async def reply(head: bytes, n: int):
        raw = _partial(head)
        yield raw[:5000]
        if n == 1:
            yield None  # cut mid-body
        else:
            yield 30.0  # stall

    async with Scripted(reply) as srv:
        rd = _reader(srv.port, body_idle_timeout_s=0.3)
        with pytest.raises(ConnectionError) as e:
            await rd.get_range("k", 0, _views([20000])[1])
        assert is_transient(e.value)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(dg.BodyStalled) as e:
            await rd.get_range("k", 0, _views([20000])[1])
        assert is_transient(e.value) and loop.time() - t0 < 2.0
        await rd.close()


@pytest.mark.parametrize("response", [
    b"HTTP/1.1 206 P\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://elsewhere/\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n",  # the range was ignored
    b"HTTP/1.1 206 P\r\nContent-Length: 100\r\nContent-Range: bytes 0-99/1048576\r\n\r\n",  # another range
    b"HTTP/1.1 206 P\r\n\r\n",  # no framing
    b"ICY 200 OK\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nContent-Length: 0\r\n\r\n",
])
async def test_what_this_reader_does_not_speak_is_unsupported(response: bytes) -> None:
    async def reply(head: bytes, n: int):
        yield response

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        with pytest.raises(dg.DirectGetUnsupported):
            await rd.get_range("k", 7, _views([100])[1])
        await rd.close()


async def test_a_gateways_unframed_error_page_is_an_error_not_a_fallback() -> None:
    async def reply(head: bytes, n: int):
        yield b"HTTP/1.1 502 Bad Gateway\r\nTransfer-Encoding: chunked\r\n\r\n5\r\noops!\r\n0\r\n\r\n"

    async with Scripted(reply) as srv:
        rd = _reader(srv.port)
        with pytest.raises(ClientError) as e:
            await rd.get_range("k", 0, _views([100])[1])
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 502 and is_transient(e.value)
        await rd.close()


def test_host_header_matches_what_botocore_signs() -> None:
    from urllib.parse import urlsplit

    from botocore.auth import _host_from_url

    for url in ("http://h:80/b", "https://h:443/b", "http://H.example:7480/b", "https://[::1]:8443/b",
                "https://bucket.s3.amazonaws.com/k"):
        assert dg._host(urlsplit(url)) == _host_from_url(url), url


async def test_a_proxy_in_the_environment_is_left_to_aiobotocore(monkeypatch) -> None:
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    rd = _reader(1)
    with pytest.raises(dg.DirectGetUnsupported, match="proxy"):
        await rd.get_range("k", 0, _views([10])[1])
