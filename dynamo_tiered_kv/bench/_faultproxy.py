"""A small fault-injecting TCP proxy for loopback tests and ``dtkv bench faults`` (asyncio, one
event loop; every method on that loop). Standard library only: the S3 tests re-export it
(``tests/infra/faultproxy.py``).

Put it between a client and an S3 server and switch its ``mode`` at any time::

    proxy = FaultProxy("127.0.0.1", 7480)
    await proxy.start()              # proxy.endpoint -> "http://127.0.0.1:<port>"
    proxy.set_mode("http503", count=2)   # the next 2 connections get a 503 SlowDown, then pass

Modes (applied per new connection; ``count`` limits how many connections get the fault):

``pass``      forward both ways
``delay``     forward, sleeping ``delay_s`` before each chunk from the server
``drop``      close the client connection at once (FIN)
``reset``     abort the client connection with RST
``http503``   read one request, answer ``503 SlowDown``, close
``stall``     accept and read, never answer (tests timeouts)
``truncate``  forward, but cut the connection after ``truncate_after`` bytes from the server
``corrupt``   forward, flipping the byte at ``corrupt_offset`` of each response body that long
``reset_body`` forward the response headers and ``body_after`` body bytes, then RST the client
              (a connection reset in the middle of a GET body)
``stall_body`` the same, but then stop forwarding and keep the connection open: a reset that
              never reaches the client (lost RST, a middlebox that dropped the flow)
``reset_half`` forward the first half of the server's first segment (status line, headers, the
              first body bytes), then RST both the client and the server connection
``stall_half`` the same cut (``half_max`` bytes at most: inside the headers when small), then
              RST the server but keep the client connection open and silent: the client's
              reset never arrives

``set_mode(..., for_s=...)`` limits the fault to connections opened within that many seconds.
``sever()`` closes every open connection (a server dying mid-transfer).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

_SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")
MODES = ("pass", "delay", "drop", "reset", "http503", "stall", "truncate", "corrupt", "reset_body", "stall_body",
         "reset_half", "stall_half")


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._bind = (host, port)
        self.mode = "pass"
        self.count: int | None = None
        self.until: float | None = None  # monotonic end of the fault window
        self.delay_s = 0.5
        self.truncate_after = 64 * 1024
        self.corrupt_offset = 5000
        self.body_after = 16 * 1024
        self.half_max: int | None = None  # cap of the ``*_half`` cut
        self.connections = 0
        self.faults = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def set_mode(self, mode: str, *, count: int | None = None, for_s: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self.mode, self.count = mode, count
        self.until = None if for_s is None else time.monotonic() + for_s

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._handle, *self._bind)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.sever()  # handlers see their sockets close and finish on their own
        if self._tasks:
            _done, stuck = await asyncio.wait(set(self._tasks), timeout=2)
            for t in stuck:
                t.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    def sever(self) -> None:
        for w in list(self._writers):
            _rst(w)

    def _take_mode(self) -> str:
        if self.mode == "pass" or (self.until is not None and time.monotonic() >= self.until):
            return "pass"
        if self.count is not None:
            if self.count <= 0:
                return "pass"
            self.count -= 1
        self.faults += 1
        return self.mode

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        mode = self._take_mode()
        try:
            if mode == "drop":
                writer.close()
                return
            if mode == "reset":
                _rst(writer)
                return
            if mode == "http503":
                await _read_request(reader)
                writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_SLOWDOWN), _SLOWDOWN))
                await writer.drain()
                writer.close()
                return
            if mode == "stall":
                while await reader.read(65536):
                    pass
                return
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_w)
            try:
                await asyncio.gather(self._pipe(reader, up_w, "up"), self._pipe(up_r, writer, mode, up_w))
            finally:
                self._writers.discard(up_w)
                up_w.close()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()
            self._tasks.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, mode: str,
                    src_w: asyncio.StreamWriter | None = None) -> None:
        sent = 0
        corrupter = _BodyCorrupter(self.corrupt_offset) if mode == "corrupt" else None
        head = b""
        body_start = -1  # offset of the first body byte in the stream, once the headers are seen
        try:
            while True:
                chunk = await src.read(65536)
                if not chunk:
                    break
                if mode in ("reset_half", "stall_half"):
                    cut = max(1, len(chunk) // 2)
                    dst.write(chunk[: cut if self.half_max is None else min(cut, self.half_max)])
                    await dst.drain()
                    if src_w is not None:
                        _rst(src_w)
                    if mode == "stall_half":
                        await dst.wait_closed()  # silent until the client gives up (or sever())
                    _rst(dst)
                    return
                if mode in ("reset_body", "stall_body"):
                    if body_start < 0:
                        head += chunk
                        end = head.find(b"\r\n\r\n")
                        if end >= 0:
                            body_start = end + 4
                    if body_start >= 0 and sent + len(chunk) > body_start + self.body_after:
                        dst.write(chunk[: body_start + self.body_after - sent])
                        await dst.drain()
                        if mode == "reset_body":
                            _rst(dst)
                            return
                        await dst.wait_closed()  # silent until the client gives up (or sever())
                        return
                if mode == "delay":
                    await asyncio.sleep(self.delay_s)
                if mode == "truncate" and sent + len(chunk) > self.truncate_after:
                    dst.write(chunk[: self.truncate_after - sent])
                    await dst.drain()
                    _rst(dst)
                    return
                if corrupter is not None:
                    chunk = corrupter.feed(chunk)
                dst.write(chunk)
                await dst.drain()
                sent += len(chunk)
        finally:
            with contextlib.suppress(Exception):
                if dst.can_write_eof():
                    dst.write_eof()


class _BodyCorrupter:
    """Tracks HTTP/1.1 responses with Content-Length and flips one byte of each long body."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.head = b""
        self.body_left = 0
        self.body_pos = 0
        self.passthrough = False  # a chunked response: stop parsing

    def feed(self, chunk: bytes) -> bytes:
        out = bytearray(chunk)
        i = 0
        while i < len(out) and not self.passthrough:
            if self.body_left == 0:
                self.head += bytes(out[i:])
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    return bytes(out)
                consumed = end + 4 - (len(self.head) - (len(out) - i))
                headers = self.head[:end].lower()
                self.head = b""
                i += consumed
                length = 0
                for line in headers.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                    if line.startswith(b"transfer-encoding:"):
                        self.passthrough = True
                self.body_left, self.body_pos = length, 0
                continue
            take = min(self.body_left, len(out) - i)
            if self.body_pos <= self.offset < self.body_pos + take:
                out[i + self.offset - self.body_pos] ^= 0xFF
            self.body_pos += take
            self.body_left -= take
            i += take
        return bytes(out)


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
            if n and b"expect: 100-continue" not in head.lower():
                await reader.readexactly(n)


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(Exception):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()
