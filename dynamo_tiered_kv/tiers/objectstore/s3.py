"""S3 object backend (aiobotocore): Ceph RGW, MinIO, AWS S3.

* Uploads: one PUT up to ``part_bytes``; larger sources are multipart uploads whose parts go out
  ``max_concurrency`` at a time (file sources are read part by part, never whole). Nothing is
  visible until CompleteMultipartUpload; a failed upload is aborted. ``if_absent`` uses
  ``If-None-Match: *`` (AWS, RGW and moto answer 412 when the object exists; a server that
  ignores the header on multipart completes is covered by a HEAD first, and by content-addressed
  names, so a lost race only costs a duplicate upload of identical bytes).
* Reads: one ranged GET per call, received straight into the caller's buffers by
  ``direct_get.DirectRangeReader`` (presigned by this client, on keep-alive connections of its
  own: 40% of the CPU of aiobotocore's body path); ``direct_reads=False``, or a server or
  environment it cannot handle, reads through aiobotocore instead. Once the response
  begins (the direct reader: its first byte; aiobotocore: the body), a gap longer than
  ``body_idle_timeout_s`` fails the attempt (and it is retried): a connection cut mid-response
  whose reset never reaches us would otherwise hold the read for the whole socket timeout, past
  the tier's read budget, instead of failing over in seconds. Reads under the tier's
  ``shared_deadline`` (``retry.py``) also give each attempt only its share of the budget.
* Before the response begins, a ranged GET waits at most ``first_byte_timeout_s`` for its first
  byte (both paths; the attempt is then retried), and a read waits two such bounds in all, over
  its attempts and their hedges, and ends after two attempts ended in silence
  (``stalls.StallAllowance``): a stalled gateway or an overloaded HDD pool costs a read about two
  seconds, not four attempts' worth or the caller's whole deadline. The first-byte latency and
  throughput of recent GETs (``latency.GetLatency``) time hedges: a GET with no answer after their
  p99 gets an identical twin, the first to answer is used (``hedge.py``); and they let the tier
  tell at once that a restore cannot arrive within its budget (``expected_get_s``).
* Payloads are signed with a plain Content-Length and checksums are only sent when an operation
  requires them (``request_checksum_calculation="when_required"``): Ceph RGW answers the
  aws-chunked uploads newer SDKs send by default with HTTP 411. So over plain HTTP nothing lets
  the server refuse a body damaged in transit: it is stored. Reads catch it (every record
  carries checksums), and the publish path never reuses a copy reported corrupt (``writes.py``).
* Faults are retried with jittered backoff and feed a circuit breaker (``retry.py``); botocore's
  own retries are off so that one policy governs every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from ...errors import ConfigError
from .backend import FileSource, ObjectBackend, ObjectInfo, Scatter, Source, source_len
from .direct_get import BodyStalled, DirectGetUnsupported, DirectRangeReader, FirstByteTimeout
from .hedge import Attempt, HedgeLost, Hedger
from .latency import GetLatency
from .retry import CircuitBreaker, RetryPolicy, call_with_retries, with_timeout
from .stalls import StallAllowance

log = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 8 << 20
MIN_PART_BYTES = 5 << 20  # S3 minimum for every part but the last
_READ_CHUNK = 1 << 20
DEFAULT_BODY_IDLE_TIMEOUT_S = 2.0
DEFAULT_FIRST_BYTE_TIMEOUT_S = 1.0
HEDGE_SHARE = 4  # hedges in flight at most: read_concurrency / HEDGE_SHARE (at least one)
_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
                    "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                    "TooManyRequests", "BadDigest", "IncompleteBody"}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound", "InvalidRange", "416"}
_T = TypeVar("_T")


class _ShortBody(Exception):
    """The server sent fewer bytes than the range asked for (connection cut)."""


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def is_transient(e: BaseException) -> bool:
    """Whether a fault is worth retrying (5xx, throttling, timeouts, resets, cut bodies)."""
    if isinstance(e, ClientError):
        return _status(e) >= 500 or _status(e) == 429 or _code(e) in _TRANSIENT_CODES
    return isinstance(e, (_ShortBody, BotoConnectionError, HTTPClientError, IncompleteReadError,
                          ResponseStreamingError, aiohttp.ClientError, ConnectionError, TimeoutError,
                          asyncio.TimeoutError))


def _missing(e: ClientError) -> bool:
    return _code(e) in _MISSING_CODES or _status(e) in (404, 416)


async def or_missing(call: Awaitable[_T]) -> _T | None:
    """``call``'s result, or None when S3 answers that the object (or the range asked for) is not
    there (404, NoSuchKey, NotFound, 416/InvalidRange). Every other error propagates."""
    try:
        return await call
    except ClientError as e:
        if _missing(e):
            return None
        raise


class S3Backend(ObjectBackend):
    """Objects under ``s3://bucket/prefix`` on an S3-compatible server.

    Args:
        bucket: bucket name (must exist unless ``create_bucket``).
        prefix: key prefix for every object ("" or ending in "/"; a missing "/" is added).
        endpoint_url: e.g. ``http://127.0.0.1:7480``; None means AWS.
        region: signing region.
        access_key, secret_key, session_token: explicit credentials; when None the standard AWS
            chain applies (env ``AWS_ACCESS_KEY_ID``..., ``profile`` in the shared credentials /
            config files, container and instance roles).
        profile: named profile from ``~/.aws/credentials`` / ``AWS_SHARED_CREDENTIALS_FILE``.
        addressing_style: "path" (default; what RGW and MinIO on an IP need) or "virtual".
        verify_tls: False disables certificate checks; a path uses that CA bundle.
        part_bytes: multipart part size (>= 5 MiB); sources up to this size are one PUT.
        max_concurrency: parts in flight per upload.
        read_concurrency: reads the caller keeps in flight (the object tier's ``max_concurrency``);
            with two uploads' parts it sizes the HTTP connection pool, so neither waits for the other.
        connect_timeout_s, read_timeout_s: socket timeouts handed to botocore.
        body_idle_timeout_s: longest silence in a GET response once it began (direct reads: headers
            too) before the attempt is abandoned and retried on a fresh connection.
        first_byte_timeout_s: longest wait for a ranged GET's first response byte (its status
            line) before the attempt is abandoned and retried.
        hedge_reads: send a second identical GET when a ranged GET's first byte is later than
            the p99 of recent GETs (``hedge.py``).
        retry: retry policy (attempts, backoff, per-attempt timeout).
        breaker_threshold, breaker_cooldown_s: circuit breaker settings.
        create_bucket: create the bucket at ``open()`` if it does not exist (tests, benches).
        direct_reads: ranged GETs through ``DirectRangeReader`` (else aiobotocore's body path).
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str = "us-east-1", access_key: str | None = None, secret_key: str | None = None,
                 session_token: str | None = None, profile: str | None = None,
                 addressing_style: str = "path", verify_tls: bool | str = True,
                 part_bytes: int = DEFAULT_PART_BYTES, max_concurrency: int = 8, read_concurrency: int = 8,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0,
                 retry: RetryPolicy | None = None, breaker_threshold: int = 5,
                 breaker_cooldown_s: float = 5.0, create_bucket: bool = False,
                 body_idle_timeout_s: float = DEFAULT_BODY_IDLE_TIMEOUT_S, direct_reads: bool = True,
                 first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S, hedge_reads: bool = True) -> None:
        super().__init__()
        if not bucket:
            raise ConfigError("S3Backend.bucket must be set")
        if part_bytes < MIN_PART_BYTES:
            raise ConfigError(f"S3Backend.part_bytes must be >= {MIN_PART_BYTES}, got {part_bytes}")
        if max_concurrency < 1 or read_concurrency < 1:
            raise ConfigError("S3Backend.max_concurrency and read_concurrency must be >= 1")
        if body_idle_timeout_s <= 0 or first_byte_timeout_s <= 0:
            raise ConfigError("S3Backend.body_idle_timeout_s and first_byte_timeout_s must be positive")
        if addressing_style not in ("path", "virtual", "auto"):
            raise ConfigError(f"S3Backend.addressing_style must be path|virtual|auto, got {addressing_style!r}")
        if (access_key is None) != (secret_key is None):
            raise ConfigError("S3Backend.access_key and secret_key must be given together")
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.endpoint_url = endpoint_url
        self.region = region
        self._access_key = access_key
        self._secret_key = secret_key
        self._session_token = session_token
        self.profile = profile
        self.addressing_style = addressing_style
        self.verify_tls = verify_tls
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        self.read_concurrency = read_concurrency
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.body_idle_timeout_s = body_idle_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.latency: GetLatency = GetLatency()  # the backend's loop only
        self.hedger = Hedger(self.latency, self.stats, max_in_flight=read_concurrency // HEDGE_SHARE,
                             first_byte_timeout_s=first_byte_timeout_s, enabled=hedge_reads)
        self.retry = retry or RetryPolicy()
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown_s)
        self.create_bucket = create_bucket
        self.url = f"s3://{bucket}/{self.prefix}"
        self._client: Any = None
        self._client_cm: Any = None
        self.direct_reads = direct_reads
        self._direct: DirectRangeReader | None = None
        self._buffers: list[bytearray] = []  # at most 2 * max_concurrency part buffers

    def __repr__(self) -> str:  # never shows credentials
        return (f"S3Backend(bucket={self.bucket!r}, prefix={self.prefix!r}, "
                f"endpoint_url={self.endpoint_url!r}, region={self.region!r})")

    # --- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        if self._client is not None:
            return
        session = get_session()
        if self.profile:
            session.set_config_variable("profile", self.profile)
        cfg = AioConfig(
            # UNSIGNED-PAYLOAD: botocore would SHA-256 every body over plain HTTP (and over HTTPS
            # without a Content-MD5), ~20 ms of CPU per 32 MiB here, and the server hashes it
            # again to check; every record carries its own checksum, verified on each read
            s3={"addressing_style": self.addressing_style, "payload_signing_enabled": False},
            signature_version="s3v4",  # presigned GETs too (botocore presigns SigV2 on custom endpoints)
            retries={"max_attempts": 1, "mode": "standard"},
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
            # the flusher's two uploads and the tier's reads run at once: room for all of them
            max_pool_connections=max(self.max_concurrency * 2 + self.read_concurrency, 10),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client_cm = session.create_client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region,
            aws_access_key_id=self._access_key, aws_secret_access_key=self._secret_key,
            aws_session_token=self._session_token, verify=self.verify_tls, config=cfg)
        self._client = await self._client_cm.__aenter__()
        if self.direct_reads:
            self._direct = DirectRangeReader(self._client, self.bucket, connect_timeout_s=self.connect_timeout_s,
                                             read_timeout_s=self.read_timeout_s,
                                             body_idle_timeout_s=self.body_idle_timeout_s, verify_tls=self.verify_tls,
                                             first_byte_timeout_s=self.first_byte_timeout_s)
        if self.create_bucket:
            await self._ensure_bucket()

    async def close(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            await direct.close()
        cm, self._client_cm, self._client = self._client_cm, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def _ensure_bucket(self) -> None:
        async def attempt() -> None:
            try:
                await self._client.head_bucket(Bucket=self.bucket)
            except ClientError as e:
                if _status(e) != 404 and _code(e) not in ("404", "NoSuchBucket"):
                    raise
                try:
                    await self._client.create_bucket(Bucket=self.bucket)
                except ClientError as e2:
                    if _code(e2) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise

        await self._call(attempt, f"create bucket {self.bucket}")

    # --- plumbing -----------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return self.prefix + name

    async def _call(self, attempt: Callable[[], Awaitable[Any]], what: str) -> Any:
        if self._client is None:
            raise RuntimeError("S3Backend used before open()")

        def count_retry() -> None:
            self.stats.retries += 1

        try:
            return await call_with_retries(attempt, policy=self.retry, breaker=self.breaker,
                                           is_transient=is_transient, what=f"{self.url}: {what}",
                                           on_retry=count_retry)
        except Exception:
            self.stats.failures += 1
            raise

    # --- writes -------------------------------------------------------------------------------
    async def put_object(self, name: str, source: Source, *, if_absent: bool = False) -> bool:
        size = source_len(source)
        if size <= self.part_bytes:
            return await self._put_single(name, source, size, if_absent)
        return await self._put_multipart(name, source, size, if_absent)

    async def _put_single(self, name: str, source: Source, size: int, if_absent: bool) -> bool:
        key = self._key(name)
        extra = {"IfNoneMatch": "*"} if if_absent else {}

        body = await _read_part(source, 0, size)  # once: retries resend the same bytes

        async def attempt() -> bool:
            try:
                await self._client.put_object(Bucket=self.bucket, Key=key, Body=body, **extra)
            except ClientError as e:
                if if_absent and _status(e) == 412:
                    return False
                raise
            return True

        wrote = await self._call(attempt, f"PUT {key}")
        if wrote:
            self.stats.puts += 1
            self.stats.bytes_written += size
        return wrote

    async def _put_multipart(self, name: str, source: Source, size: int, if_absent: bool) -> bool:
        key = self._key(name)
        create = self._call(
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=key), f"create upload {key}")
        if not if_absent:
            created = await create
        else:
            # Some servers (Ceph RGW 16) ignore If-None-Match on CompleteMultipartUpload, so look
            # first; the HEAD overlaps the upload's creation and costs no extra round trip.
            existing, created = await asyncio.gather(self.head(name), create, return_exceptions=True)
            if isinstance(created, BaseException):
                raise created
            if isinstance(existing, BaseException) or existing is not None:
                await self._abort(key, created["UploadId"])
                if isinstance(existing, BaseException):
                    raise existing
                return False
        upload_id = created["UploadId"]
        pb = self.part_bytes
        n_parts = -(-size // pb)
        etags: list[str | None] = [None] * n_parts
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one_part(i: int) -> None:
            off, length = i * pb, min(pb, size - i * pb)
            async with sem:
                buf = self._take_buffer() if length == pb else None
                try:
                    body = await _read_part(source, off, length, buf)

                    async def attempt() -> None:
                        r = await self._client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                           PartNumber=i + 1, Body=body)
                        etags[i] = r["ETag"]

                    await self._call(attempt, f"upload part {i + 1}/{n_parts} of {key}")
                finally:
                    if buf is not None:
                        self._give_buffer(buf)

        try:
            tasks = [asyncio.ensure_future(one_part(i)) for i in range(n_parts)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            parts = [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]
            extra = {"IfNoneMatch": "*"} if if_absent else {}

            async def complete() -> bool:
                try:
                    await self._client.complete_multipart_upload(
                        Bucket=self.bucket, Key=key, UploadId=upload_id,
                        MultipartUpload={"Parts": parts}, **extra)
                except ClientError as e:
                    if if_absent and _status(e) == 412:
                        return False
                    if _code(e) == "NoSuchUpload":  # an earlier attempt completed it
                        return True
                    raise
                return True

            wrote = await self._call(complete, f"complete upload {key}")
        except BaseException:
            await self._abort(key, upload_id)
            raise
        if not wrote:
            await self._abort(key, upload_id)
            return False
        self.stats.puts += 1
        self.stats.bytes_written += size
        return True

    def _take_buffer(self) -> bytearray:
        # Part buffers are reused across uploads: a fresh 8 MiB allocation costs more in page
        # faults than the copy into it (project rule: no allocation on the hot path).
        return self._buffers.pop() if self._buffers else bytearray(self.part_bytes)

    def _give_buffer(self, buf: bytearray) -> None:
        if len(self._buffers) < 2 * self.max_concurrency:
            self._buffers.append(buf)

    async def _abort(self, key: str, upload_id: str) -> None:
        with contextlib.suppress(Exception):
            await with_timeout(
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id),
                self.retry.attempt_timeout_s)

    # --- reads --------------------------------------------------------------------------------
    async def get_range(self, name: str, offset: int, dests: Sequence[memoryview]) -> int | None:
        key = self._key(name)
        total = sum(d.nbytes for d in dests)
        if total == 0:
            return 0 if await self.head(name) is not None else None
        stalls = StallAllowance(self.first_byte_timeout_s)  # the read's silence, over its attempts

        async def attempt() -> int | None:
            bound = stalls.bound()
            try:
                return await self.hedger.run(lambda a: self._get_once(key, offset, dests, total, a, bound))
            except BodyStalled as e:
                stalled = stalls.ended_in_silence(e)
                if stalled is None:
                    raise  # retried
                raise stalled from e

        n = await self._call(attempt, f"GET {key} [{offset}, +{total})")
        self.stats.gets += 1
        if n:
            self.stats.bytes_read += n
        return n

    def expected_get_s(self, nbytes: int) -> float | None:
        return self.latency.expected_s(nbytes)

    async def _get_once(self, key: str, offset: int, dests: Sequence[memoryview], total: int,
                        attempt: Attempt, first_byte_s: float) -> int | None:
        """One GET of the range (one attempt of a possibly hedged read): direct, else aiobotocore.
        ``first_byte_s``: how long it waits for its first response byte."""
        direct = self._direct
        if direct is not None:
            try:
                got = await direct.get_range(key, offset, dests, attempt, first_byte_s)
                self.stats.direct_gets += 1
                return got
            except DirectGetUnsupported as e:  # raised before any body byte: nothing was stored
                if self._direct is direct:  # a hedged twin may have given up on it already
                    self._direct = None
                    self.stats.direct_fallbacks += 1
                    log.warning("%s: ranged GETs go through aiobotocore from now on: %s", self.url, e)
                await direct.close()
        try:  # returns once the headers are in: this bounds the wait for the first byte
            resp = await with_timeout(or_missing(self._client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + total - 1}")), first_byte_s)
        except (asyncio.TimeoutError, TimeoutError):
            attempt.no_first_byte()
            raise FirstByteTimeout(f"no response within {first_byte_s:.3g}s of the request") from None
        attempt.first_byte()
        if resp is None:
            return None
        body = resp["Body"]
        try:
            if int(resp.get("ContentLength", -1)) != total:
                return None  # object shorter than the range
            if not attempt.own():
                raise HedgeLost("a hedged GET of the same range answered first")
            out = Scatter(dests)
            while out.written < total:
                try:  # read() returns what has arrived, so this bounds silence, not throughput
                    chunk = await with_timeout(body.read(min(_READ_CHUNK, total - out.written)),
                                               self.body_idle_timeout_s)
                except (asyncio.TimeoutError, TimeoutError):
                    raise BodyStalled(f"body stalled at {out.written} of {total} bytes for "
                                      f"{self.body_idle_timeout_s}s") from None
                if not chunk:
                    raise _ShortBody(f"body ended at {out.written} of {total} bytes")
                out.write(chunk)
            attempt.finished(total)
            return total
        finally:
            body.close()  # closes (never pools) a connection whose body was not read to its end

    async def get_bytes(self, name: str) -> bytes | None:
        key = self._key(name)

        async def attempt() -> bytes | None:
            resp = await or_missing(self._client.get_object(Bucket=self.bucket, Key=key))
            if resp is None:
                return None
            async with resp["Body"] as body:
                data = await body.read()
            if len(data) != int(resp.get("ContentLength", len(data))):
                raise _ShortBody(f"{key}: got {len(data)} bytes")
            return data

        data = await self._call(attempt, f"GET {key}")
        self.stats.gets += 1
        if data:
            self.stats.bytes_read += len(data)
        return data

    async def head(self, name: str) -> ObjectInfo | None:
        key = self._key(name)

        async def attempt() -> ObjectInfo | None:
            r = await or_missing(self._client.head_object(Bucket=self.bucket, Key=key))
            if r is None:
                return None
            return ObjectInfo(name, int(r["ContentLength"]), r["LastModified"].timestamp())

        self.stats.heads += 1
        return await self._call(attempt, f"HEAD {key}")

    async def list(self, prefix: str = "", *, start_after: str = "") -> list[ObjectInfo]:
        full = self._key(prefix)
        cut = len(self.prefix)
        extra = {"StartAfter": self._key(start_after)} if start_after else {}

        async def attempt() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            paginator = self._client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=full, **extra):
                for o in page.get("Contents", []):
                    out.append(ObjectInfo(o["Key"][cut:], int(o["Size"]), o["LastModified"].timestamp()))
            return out

        self.stats.lists += 1
        return await self._call(attempt, f"LIST {full}")

    async def list_dirs(self, prefix: str) -> list[str]:
        full = self._key(prefix)

        async def attempt() -> list[str]:
            out: list[str] = []
            paginator = self._client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
                out += [p["Prefix"][len(full):].rstrip("/") for p in page.get("CommonPrefixes", [])]
            return sorted(out)

        self.stats.lists += 1
        return await self._call(attempt, f"LIST {full}/*")

    async def delete(self, name: str) -> bool:
        key = self._key(name)

        async def attempt() -> bool:
            return await or_missing(self._client.delete_object(Bucket=self.bucket, Key=key)) is not None

        self.stats.deletes += 1
        return await self._call(attempt, f"DELETE {key}")

    async def abort_incomplete(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s

        async def attempt() -> list[tuple[str, str]]:
            stale: list[tuple[str, str]] = []
            paginator = self._client.get_paginator("list_multipart_uploads")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for u in page.get("Uploads", []):
                    if u["Initiated"].timestamp() < cutoff:
                        stale.append((u["Key"], u["UploadId"]))
            return stale

        stale = await self._call(attempt, "list uploads")
        for key, upload_id in stale:
            await self._abort(key, upload_id)
        return len(stale)


async def _read_part(source: Source, off: int, length: int, into: bytearray | None = None) -> bytes | bytearray:
    """The bytes of one part, in ``into`` when given (exactly ``length`` long). A worker thread
    reads file sources so the loop never blocks."""
    if isinstance(source, FileSource):
        if into is not None:
            return await asyncio.to_thread(_pread_into, source.path, source.offset + off, into)
        return await asyncio.to_thread(_pread_exact, source.path, source.offset + off, length)
    view = memoryview(source).cast("B")[off:off + length]
    if into is not None:
        into[:] = view
        return into
    return bytes(view)


def _pread_exact(path: os.PathLike[str], off: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, length, off)
    finally:
        os.close(fd)
    if len(data) != length:
        raise OSError(f"{path}: short read at {off} ({len(data)} of {length} bytes)")
    return data


def _pread_into(path: os.PathLike[str], off: int, into: bytearray) -> bytearray:
    fd = os.open(path, os.O_RDONLY)
    try:
        view, done = memoryview(into), 0
        while done < len(into):
            n = os.preadv(fd, [view[done:]], off + done)
            if n <= 0:
                raise OSError(f"{path}: short read at {off + done} ({done} of {len(into)} bytes)")
            done += n
    finally:
        os.close(fd)
    return into
