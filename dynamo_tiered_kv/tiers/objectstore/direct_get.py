"""Ranged GETs whose body the kernel copies straight into the caller's buffers.

aiobotocore reads a GET body through aiohttp: every ``recv`` lands in a new bytes object, the
parser queues it, a read joins the queue and the backend copies the result into the slab. That
cost 0.7-0.8 ms of CPU per MiB here (48 ms per 64 MiB from Ceph RGW on loopback), on the
store's loop: a CPU engine's forward pays it, and a GPU host pays it per GB/s it restores. This
reader sends the same GET, presigned by the backend's own botocore client (credentials, session
tokens, endpoint, region and addressing style are the client's), over keep-alive connections of
its own whose ``asyncio.BufferedProtocol`` hands the socket the destination buffers: 17-21 ms
per 64 MiB, most of it the kernel's copy.

Only plain HTTP/1.1 framing is handled: a status line, headers, a body of ``Content-Length``
bytes. A ``206`` must carry the asked ``Content-Range``; an S3 error status becomes the
``ClientError`` botocore would raise, so retries, misses and the circuit breaker treat it as
before. Anything else (chunked or unframed bodies, redirects, a proxy in the environment, a
range the server ignored) raises ``DirectGetUnsupported``; the backend then reads through
aiobotocore for good.

Bounds of one GET: its first response byte within ``first_byte_timeout_s`` of the request
(``FirstByteTimeout``: a stalled gateway fails the attempt in about a second, and it is retried
within the caller's budget; a caller may pass a tighter bound per GET: ``S3Backend`` gives a
retry what is left of the read's first-byte allowance), then no silence longer than
``body_idle_timeout_s``. A GET run as an
``hedge.Attempt`` reports its first byte and takes ownership of the destination buffers right
before its first body byte is stored: a hedged twin that lost never writes there.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from botocore.exceptions import ClientError
from botocore.httpsession import get_cert_path

from .hedge import Attempt, HedgeLost
from .retry import with_timeout

HEAD_MAX = 64 << 10  # longest status line + headers accepted
ERROR_BODY_MAX = 64 << 10  # longest error document read (longer: the connection is dropped)
PRESIGN_TTL_S = 3600
PRESIGN_REUSE_S = 3000  # a cached URL is reused for this long, well inside its expiry
PRESIGN_CACHE = 4096  # objects whose URL is kept
IDLE_PER_HOST = 64  # keep-alive connections kept per host
IDLE_MAX_S = 10.0  # a pooled connection idle longer is closed (NATs and balancers drop them silently)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")


class DirectGetUnsupported(Exception):
    """The server or the environment needs more HTTP than this reader speaks."""


class BodyStalled(ConnectionError):
    """The server sent nothing for the idle timeout (before its first response byte: the first-byte bound)."""


class FirstByteTimeout(BodyStalled):
    """No response byte (status line) within the first-byte bound of the request."""


class _Response(asyncio.BufferedProtocol):
    """One keep-alive connection; one request at a time. Headers and error bodies are received
    into a small buffer, a success body straight into the destination views."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._scratch = bytearray(HEAD_MAX)
        self.done: asyncio.Future[None] | None = None
        self._begin(())

    # --- per request --------------------------------------------------------------------------
    def _begin(self, dests: Sequence[memoryview], total: int = 0, offset: int = 0,
               attempt: Attempt | None = None) -> None:
        # zero-length views dropped: get_buffer must never hand the transport an empty buffer
        self._dests = [d.cast("B") if d.format != "B" or d.ndim != 1 else d for d in dests if d.nbytes]
        self._total, self._offset = total, offset
        self._attempt = attempt
        self._i = self._pos = self.got = 0
        self._head = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.error_body = bytearray()
        self.keep_alive = True
        self.short = False  # the object ends inside the range: a miss
        self.progress = 0  # bytes received
        self.last_io = time.monotonic()  # when the last of them arrived (the idle timeout)
        self._phase = "idle"  # head -> body | error | short -> done

    def start(self, dests: Sequence[memoryview], total: int, offset: int,
              attempt: Attempt | None = None) -> asyncio.Future[None]:
        self._begin(dests, total, offset, attempt)
        self._phase = "head"
        self.done = asyncio.get_running_loop().create_future()
        if self.closed:  # the peer closed it before the request went out
            self._fail(ConnectionResetError("connection closed before the request"))
        return self.done

    # --- protocol -----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is None or not isinstance(exc, ConnectionError):  # OSError, SSLError: transient too
            exc = ConnectionResetError(f"connection lost after {self.progress} bytes of the response"
                                       + (f": {exc}" if exc is not None else ""))
        self._fail(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase == "body":
            return self._dests[self._i][self._pos:]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self.progress == 0 and self._attempt is not None and self._phase == "head":
            self._attempt.first_byte()
        self.progress += nbytes
        self.last_io = time.monotonic()
        if self._phase == "body":
            self._advance(nbytes)
        elif self._phase in ("head", "error"):
            self._feed(memoryview(self._scratch)[:nbytes])
        else:  # bytes nobody asked for: the connection is out of step
            self._close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost settles the request

    # --- parsing ------------------------------------------------------------------------------
    def _feed(self, data: memoryview) -> None:
        if self._phase == "error":
            self._take_error(data)
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > HEAD_MAX:
                self._fail(DirectGetUnsupported("response headers longer than 64 KiB"))
            return
        try:
            self._parse_head(bytes(self._head[:end]))
            length = self._framing()
        except DirectGetUnsupported as e:
            if self.status >= 400:  # a gateway's odd error page: an error, not a reason to give up
                self._fail(_client_error(self.status, b""))
            else:
                self._fail(e)
            return
        rest = memoryview(self._head)[end + 4:]
        if 200 <= self.status < 300:
            if not self._ranged(length):
                return
            if self._attempt is not None and not self._attempt.own():
                self._fail(HedgeLost("a hedged GET of the same range answered first"))
                return
            self._phase = "body"
            if rest.nbytes:
                self._copy(rest)
            elif self._total == 0:
                self._finish()
        else:
            self._phase = "error"
            self._error_left = length
            if length > ERROR_BODY_MAX:
                self.keep_alive = False
                self._finish()
            else:
                self._take_error(rest)

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise DirectGetUnsupported(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        if int(parts[1]) < 200:
            raise DirectGetUnsupported(f"interim response HTTP {int(parts[1])}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                self.headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if parts[0] == b"HTTP/1.0" or self.headers.get("connection", "").lower() == "close":
            self.keep_alive = False

    def _framing(self) -> int:
        if "transfer-encoding" in self.headers:
            raise DirectGetUnsupported(f"Transfer-Encoding {self.headers['transfer-encoding']!r}")
        if 300 <= self.status < 400:
            raise DirectGetUnsupported(f"HTTP {self.status} redirect")
        cl = self.headers.get("content-length", "")
        if not cl.isdigit():
            raise DirectGetUnsupported(f"HTTP {self.status} without Content-Length")
        return int(cl)

    def _ranged(self, length: int) -> bool:
        """Whether the body is the asked range; if not, the request is settled (or failed) here."""
        last = self._offset + self._total - 1
        if self.status == 206:
            m = _CONTENT_RANGE.match(self.headers.get("content-range", ""))
            if m is None or int(m.group(1)) != self._offset:
                self._fail(DirectGetUnsupported(f"Content-Range {self.headers.get('content-range')!r} "
                                                f"for bytes {self._offset}-{last}"))
                return False
            if length != self._total or int(m.group(2)) != last:  # the object ends inside the range
                self._short()
                return False
            return True
        if self.status == 200 and self._offset == 0 and length <= self._total:
            if length == self._total:
                return True  # a range over the whole object, sent whole
            self._short()  # the whole object, shorter than the range
            return False
        self._fail(DirectGetUnsupported(f"HTTP {self.status} with {length} bytes for range "
                                        f"{self._offset}-{last} (range ignored?)"))
        return False

    def _take_error(self, data: memoryview) -> None:
        take = min(data.nbytes, self._error_left)
        self.error_body += data[:take]
        self._error_left -= take
        if data.nbytes > take:
            self.keep_alive = False
        if self._error_left == 0:
            self._finish()

    # --- body -----------------------------------------------------------------------------------
    def _copy(self, data: memoryview) -> None:
        while data.nbytes and self._phase == "body":
            d = self._dests[self._i]
            n = min(data.nbytes, d.nbytes - self._pos)
            d[self._pos:self._pos + n] = data[:n]
            data = data[n:]
            self._advance(n)
        if data.nbytes:  # more than Content-Length: out of step
            self.keep_alive = False

    def _advance(self, n: int) -> None:
        self._pos += n
        self.got += n
        while self._i < len(self._dests) and self._pos >= self._dests[self._i].nbytes:
            self._i += 1
            self._pos = 0
        if self.got >= self._total:
            self._finish()

    # --- settling -------------------------------------------------------------------------------
    def _short(self) -> None:
        """A body we do not read: the object ends inside the range (a miss); drop the connection."""
        self.short = True
        self._finish()
        self._close()

    def _finish(self) -> None:
        self._phase = "done"
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, e: BaseException) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(e)
        self._close()

    def _close(self) -> None:
        """Stop at once: no byte more reaches the destination views (abort: no TLS shutdown wait)."""
        self.keep_alive = False
        self._phase = "done"
        self._dests = []
        if self.done is not None and not self.done.done():
            self.done.cancel()  # its waiter has gone: nothing to report to
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


class DirectRangeReader:
    """``get_range`` over pooled keep-alive connections; one instance per ``S3Backend``.

    Args:
        client: the backend's aiobotocore S3 client (used to presign only).
        bucket: the bucket every key lives in.
        connect_timeout_s: TCP (and TLS) connect bound.
        read_timeout_s: bound on the wait for the first response byte when no tighter
            ``first_byte_timeout_s`` is given.
        body_idle_timeout_s: longest silence once the response has begun (headers or body).
        first_byte_timeout_s: bound on the wait for the first response byte (None: ``read_timeout_s``).
        verify_tls: as for botocore: False skips certificate checks, a path is a CA bundle.
    """

    def __init__(self, client: Any, bucket: str, *, connect_timeout_s: float, read_timeout_s: float,
                 body_idle_timeout_s: float, verify_tls: bool | str = True,
                 first_byte_timeout_s: float | None = None) -> None:
        self._client = client
        self.bucket = bucket
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.first_byte_timeout_s = read_timeout_s if first_byte_timeout_s is None else min(
            first_byte_timeout_s, read_timeout_s)
        self.body_idle_timeout_s = body_idle_timeout_s
        self._verify_tls = verify_tls
        self._ssl: ssl.SSLContext | None = None
        self._urls: OrderedDict[str, tuple[urllib.parse.SplitResult, float]] = OrderedDict()
        self._idle: dict[tuple[str, int, bool], list[tuple[_Response, float]]] = {}
        self._closed = False
        self.connections = 0  # connections it opened

    async def close(self) -> None:
        self._closed = True  # reads still in flight close their connections when they end
        for conns in self._idle.values():
            for c, _ in conns:
                c._close()
        self._idle.clear()

    async def get_range(self, key: str, offset: int, dests: Sequence[memoryview],
                        attempt: Attempt | None = None, first_byte_timeout_s: float | None = None) -> int | None:
        """Bytes ``[offset, offset + total)`` of ``key`` into ``dests``: ``total``, or None when the
        object is missing or shorter. Raises ``ClientError`` for S3 errors, ``ConnectionError``
        or ``TimeoutError`` for transport faults (``FirstByteTimeout``, ``HedgeLost`` among them),
        ``DirectGetUnsupported`` as said above. ``attempt``: this GET is one of a hedged read.
        ``first_byte_timeout_s``: this GET's first-byte bound when tighter than the reader's (the
        rest of a read's first-byte allowance, ``s3.STALL_WAITS``)."""
        total = sum(d.nbytes for d in dests)
        first_byte_s = self.first_byte_timeout_s if first_byte_timeout_s is None else min(
            first_byte_timeout_s, self.first_byte_timeout_s)
        resigned = redialed = False
        while True:
            parts, cached = await self._presigned(key)
            conn = await self._connection(parts, fresh=redialed)
            try:
                await self._exchange(conn, parts, offset, total, dests, attempt, first_byte_s)
            except BaseException as e:
                conn._close()
                if (isinstance(e, ConnectionError) and not isinstance(e, BodyStalled) and conn.reused
                        and conn.progress == 0 and not redialed):
                    redialed = True  # a keep-alive connection the server had closed: once more, new
                    continue
                raise
            self._release(parts, conn)
            status = conn.status
            if status in (404, 416) or conn.short:
                return None
            if status in (400, 403):  # signed with credentials that expired or rotated since
                self._urls.clear()
                if cached and not resigned:
                    resigned = True
                    continue
            if status >= 300:
                raise _client_error(status, bytes(conn.error_body))
            if conn.got != total:  # pragma: no cover - the protocol settles a 2xx only when complete
                raise ConnectionResetError(f"body ended at {conn.got} of {total} bytes")
            if attempt is not None:
                attempt.finished(total)
            return total

    async def _exchange(self, conn: _Response, parts: urllib.parse.SplitResult, offset: int, total: int,
                        dests: Sequence[memoryview], attempt: Attempt | None, first_byte_s: float) -> None:
        done = conn.start(dests, total, offset, attempt)
        target = parts.path + ("?" + parts.query if parts.query else "")
        assert conn.transport is not None
        conn.transport.write(
            f"GET {target} HTTP/1.1\r\nHost: {_host(parts)}\r\nRange: bytes={offset}-{offset + total - 1}\r\n"
            f"Accept-Encoding: identity\r\nUser-Agent: dynamo-tiered-kv\r\n\r\n".encode("latin-1"))
        sent = time.monotonic()
        while True:
            # until the first response byte: first_byte_timeout_s from the request (a stalled
            # gateway costs an attempt, not the caller's budget); from then on body_idle_timeout_s
            # of silence, headers included (a response cut inside its headers whose reset never
            # arrives must not hold the read)
            started = conn.progress > 0
            limit = conn.last_io + self.body_idle_timeout_s if started else sent + first_byte_s
            left = limit - time.monotonic()
            if left > 0:
                await asyncio.wait((done,), timeout=min(left, self.body_idle_timeout_s))
            if done.done():
                done.result()  # raises what the protocol failed with
                return
            if left <= 0 and not started:
                if attempt is not None:
                    attempt.no_first_byte()
                raise FirstByteTimeout(f"no response byte within {first_byte_s:.3g}s of the request")
            if left <= 0:
                raise BodyStalled(f"no response bytes for {self.body_idle_timeout_s}s into the response "
                                  f"({conn.progress} bytes, {conn.got} of {total} body bytes)")

    # --- connections ------------------------------------------------------------------------------
    async def _connection(self, parts: urllib.parse.SplitResult, fresh: bool = False) -> _Response:
        host, port, tls = key = _endpoint(parts)
        idle = self._idle.get(key, [])
        now = time.monotonic()
        while idle and not fresh:
            c, since = idle.pop()
            if now - since < IDLE_MAX_S and not c.closed and c.transport is not None and not c.transport.is_closing():
                c.reused = True
                return c
            c._close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await with_timeout(
                loop.create_connection(_Response, host, port, ssl=self._context() if tls else None,
                                       server_hostname=host if tls else None),
                self.connect_timeout_s)
        except ssl.SSLCertVerificationError as e:
            raise DirectGetUnsupported(f"TLS certificate of {host}: {e}") from e
        except ConnectionError:
            raise
        except OSError as e:  # DNS, unreachable, TLS: transient, as botocore's EndpointConnectionError
            raise ConnectionError(f"connect to {host}:{port}: {e}") from e
        self.connections += 1
        return conn

    def _release(self, parts: urllib.parse.SplitResult, conn: _Response) -> None:
        if not conn.keep_alive or conn.closed or self._closed:
            conn._close()
            return
        pool = self._idle.setdefault(_endpoint(parts), [])
        if len(pool) < IDLE_PER_HOST:
            pool.append((conn, time.monotonic()))
        else:
            conn._close()

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            ctx = ssl.create_default_context()
            if self._verify_tls is False:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            else:  # the CA bundle botocore verifies against (certifi's, or the given path)
                ctx.load_verify_locations(cafile=get_cert_path(self._verify_tls))
            self._ssl = ctx
        return self._ssl

    # --- signing ----------------------------------------------------------------------------------
    async def _presigned(self, key: str) -> tuple[urllib.parse.SplitResult, bool]:
        """(parsed URL, whether it came from the cache)."""
        now = time.monotonic()
        hit = self._urls.get(key)
        if hit is not None and now - hit[1] < PRESIGN_REUSE_S:
            self._urls.move_to_end(key)
            return hit[0], True
        url = await self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=PRESIGN_TTL_S)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise DirectGetUnsupported(f"presigned URL scheme {parts.scheme!r}")
        if _proxied(parts):
            raise DirectGetUnsupported(f"a proxy is configured for {parts.hostname}")
        self._urls[key] = (parts, now)
        if len(self._urls) > PRESIGN_CACHE:
            self._urls.popitem(last=False)
        return parts, False


def _endpoint(parts: urllib.parse.SplitResult) -> tuple[str, int, bool]:
    """(host, port, TLS): what a connection is pooled by."""
    tls = parts.scheme == "https"
    return parts.hostname or "", parts.port or (443 if tls else 80), tls


def _proxied(parts: urllib.parse.SplitResult) -> bool:
    proxies = urllib.request.getproxies()
    return bool(proxies.get(parts.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(
        parts.hostname or "")


def _host(parts: urllib.parse.SplitResult) -> str:
    """The Host header botocore signed (``auth._host_from_url``): no default port."""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != {"http": 80, "https": 443}.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def _client_error(status: int, body: bytes) -> ClientError:
    """The ``ClientError`` botocore raises for this S3 error response."""
    code = _CODE.search(body)
    msg = _MESSAGE.search(body)
    return ClientError({"Error": {"Code": code.group(1).decode(errors="replace") if code else str(status),
                                  "Message": msg.group(1).decode(errors="replace") if msg else ""},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
