"""Backend-level behaviour (local directory and S3 via moto), manifests, retry and breaker."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.errors import ConfigError, TierUnavailable
from dynamo_tiered_kv.testing import make_record, random_key
from dynamo_tiered_kv.tiers.objectstore import (
    CircuitBreaker,
    FileSource,
    LocalDirBackend,
    Manifest,
    ManifestError,
    ObjectBackend,
    ObjectTier,
    RetryPolicy,
    S3Backend,
    backend_from_url,
)
from dynamo_tiered_kv.tiers.objectstore.retry import call_with_retries, shared_deadline
from dynamo_tiered_kv.tiers.segments import SegmentEntry

pytest_plugins = ["infra.fixtures_s3"]


@pytest.fixture(params=["localdir", "moto"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "localdir":
        b: ObjectBackend = LocalDirBackend(tmp_path / "objs")
    else:
        server: S3Server = request.getfixturevalue("moto_s3")
        b = S3Backend(unique_bucket("be"), "pre/", part_bytes=5 << 20, **server.backend_kwargs())
    await b.open()
    yield b
    await b.close()


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256) + b"\x07" * (n % 256)


async def test_put_get_head_list_delete(backend: ObjectBackend) -> None:
    data = _payload(10_000)
    assert await backend.put_object("data/a.seg", data) is True
    info = await backend.head("data/a.seg")
    assert info is not None and info.size == len(data) and info.mtime > 0
    assert await backend.head("data/missing") is None
    assert await backend.get_bytes("data/a.seg") == data
    assert await backend.get_bytes("data/missing") is None
    assert [o.name for o in await backend.list("data/")] == ["data/a.seg"]
    assert await backend.list("manifests/") == []
    assert await backend.delete("data/a.seg") is True
    assert await backend.head("data/a.seg") is None


async def test_ranged_get_scatters_into_buffers(backend: ObjectBackend) -> None:
    data = _payload(50_000, seed=3)
    await backend.put_object("x", data)
    a, b, c = bytearray(100), bytearray(7000), bytearray(1)
    assert await backend.get_range("x", 1234, [memoryview(a), memoryview(b), memoryview(c)]) == 7101
    assert bytes(a) + bytes(b) + bytes(c) == data[1234:1234 + 7101]
    assert await backend.get_range("x", len(data) - 10, [memoryview(bytearray(20))]) is None  # past the end
    assert await backend.get_range("nope", 0, [memoryview(bytearray(10))]) is None


async def test_put_if_absent_never_replaces(backend: ObjectBackend) -> None:
    assert await backend.put_object("k", b"first", if_absent=True) is True
    assert await backend.put_object("k", b"second", if_absent=True) is False
    assert await backend.get_bytes("k") == b"first"
    assert await backend.put_object("k", b"third") is True  # a plain put replaces
    assert await backend.get_bytes("k") == b"third"


async def test_large_file_source_is_multipart_and_atomic(backend: ObjectBackend, tmp_path: Path) -> None:
    src = tmp_path / "seg"
    data = _payload(12 << 20, seed=5)  # 3 parts of 5 MiB on S3
    src.write_bytes(b"HEAD" + data)
    fs = FileSource(src, len(data), offset=4)
    assert await backend.put_object("data/big.seg", fs, if_absent=True) is True
    assert await backend.put_object("data/big.seg", fs, if_absent=True) is False  # dedup, no second upload
    buf = bytearray(len(data))
    assert await backend.get_range("data/big.seg", 0, [memoryview(buf)]) == len(data)
    assert bytes(buf) == data
    assert [o.name for o in await backend.list("")] == ["data/big.seg"]  # no temp or partial objects


async def test_localdir_never_shows_partial_files(tmp_path: Path) -> None:
    b = LocalDirBackend(tmp_path)
    await b.open()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / ".x.seg.123.partial").write_bytes(b"half")  # a crash mid-publish
    assert await b.list("") == []
    old = time.time() - 7200
    os.utime(tmp_path / "data" / ".x.seg.123.partial", (old, old))
    assert await b.abort_incomplete(3600) == 1
    with pytest.raises(ValueError):
        await b.put_object("../escape", b"x")


def test_manifest_roundtrip_and_damage() -> None:
    e = (SegmentEntry(random_key(1), 0, 8192), SegmentEntry(random_key(2), 8192, 4096))
    m = Manifest("data/ab.seg", 16384, 1234.5, e, "node-a")
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert m.name.startswith("manifests/") and m.with_entries(e[:1]).name != m.name
    raw = m.to_bytes()
    for bad in (raw[:-5], raw.replace(b"8192", b"8193"), b"not json", b"{}"):
        with pytest.raises(ManifestError):
            Manifest.from_bytes(bad)
    with pytest.raises(ManifestError):
        Manifest("data/ab.seg", 100, 0.0, e)  # entries beyond the object


def test_s3_config_validation_and_secret_free_repr() -> None:
    b = S3Backend("bkt", "p", endpoint_url="http://127.0.0.1:1", access_key="AKIDSECRET", secret_key="SHH")
    assert "SHH" not in repr(b) and "AKIDSECRET" not in repr(b) and b.prefix == "p/"
    for bad in ({"part_bytes": 1 << 20}, {"max_concurrency": 0}, {"addressing_style": "weird"},
                {"access_key": "only-one"}):
        with pytest.raises(ConfigError):
            S3Backend("bkt", **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        S3Backend("")


def test_backend_from_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DTKV_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("DTKV_S3_ACCESS_KEY", "a")
    monkeypatch.setenv("DTKV_S3_SECRET_KEY", "b")
    b = backend_from_url("s3://bucket/some/prefix")
    assert isinstance(b, S3Backend) and b.bucket == "bucket" and b.prefix == "some/prefix/"
    assert b.endpoint_url == "http://127.0.0.1:9"
    assert backend_from_url("s3://bucket", endpoint_url="http://x:1").endpoint_url == "http://x:1"
    d = backend_from_url(f"file://{tmp_path}")
    assert isinstance(d, LocalDirBackend) and d.root == tmp_path
    for bad in ("http://x/y", "s3://", "file://host/dir"):
        with pytest.raises(ConfigError):
            backend_from_url(bad)


async def test_retry_then_breaker_with_injected_clock() -> None:
    now = [0.0]
    br = CircuitBreaker(failure_threshold=2, cooldown_s=10, clock=lambda: now[0])
    pol = RetryPolicy(max_attempts=3, base_delay_s=0, max_delay_s=0, attempt_timeout_s=1)
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert await call_with_retries(flaky, policy=pol, breaker=br, is_transient=lambda e: True, what="t") == "ok"
    assert len(calls) == 3 and br.state == "closed"

    async def dead() -> None:
        raise ConnectionResetError("down")

    for _ in range(2):
        with pytest.raises(TierUnavailable):
            await call_with_retries(dead, policy=pol, breaker=br, is_transient=lambda e: True, what="t")
    assert br.state == "open"
    with pytest.raises(TierUnavailable, match="breaker"):
        await call_with_retries(flaky, policy=pol, breaker=br, is_transient=lambda e: True, what="t")
    now[0] = 11
    assert br.state == "half-open"
    with pytest.raises(TierUnavailable):  # the probe fails: open again for a full cooldown
        await call_with_retries(dead, policy=pol, breaker=br, is_transient=lambda e: True, what="t")
    assert br.state == "open"
    now[0] = 22
    calls.clear()
    calls.extend([1, 1])
    assert await call_with_retries(flaky, policy=pol, breaker=br, is_transient=lambda e: True, what="t") == "ok"
    assert br.state == "closed" and br.opened_count == 1  # one outage, however many probes

    async def permanent() -> None:
        raise PermissionError("403")

    with pytest.raises(TierUnavailable):  # not transient: no retries
        await call_with_retries(permanent, policy=pol, breaker=br, is_transient=lambda e: False, what="t")

    async def slow() -> None:
        await asyncio.sleep(10)

    fast = RetryPolicy(max_attempts=2, base_delay_s=0, attempt_timeout_s=0.05)
    with pytest.raises(TierUnavailable, match="2 attempts"):
        await call_with_retries(slow, policy=fast, breaker=CircuitBreaker(), is_transient=lambda e: True, what="t")


async def test_retries_share_the_callers_deadline() -> None:
    """Under ``shared_deadline`` a hanging attempt gets its share of the time left, the later
    attempts still run, and the call raises before the caller's deadline."""
    calls = 0

    async def hangs() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            await asyncio.Event().wait()  # a connection that went silent
        return "ok"

    pol = RetryPolicy(max_attempts=4, base_delay_s=0, max_delay_s=0, attempt_timeout_s=3600)
    with shared_deadline(4.0):
        got = await asyncio.wait_for(call_with_retries(hangs, policy=pol, breaker=CircuitBreaker(),
                                                       is_transient=lambda e: True, what="t"), 30)
    assert got == "ok" and calls == 3  # the third attempt ran inside the 4 s (after shares of 1 s, 1 s)
    calls = -100  # every attempt hangs
    with shared_deadline(1.0), pytest.raises(TierUnavailable, match="failed after"):
        await asyncio.wait_for(call_with_retries(hangs, policy=pol, breaker=CircuitBreaker(),
                                                 is_transient=lambda e: True, what="t"), 30)
    with shared_deadline(0.0), pytest.raises(TierUnavailable, match="no time left"):  # spent: no request
        await call_with_retries(hangs, policy=pol, breaker=CircuitBreaker(), is_transient=lambda e: True, what="t")


async def test_a_probe_cancelled_in_its_backoff_reopens_the_breaker() -> None:
    """A half-open probe cancelled while it waits to retry (its read's deadline, a sibling run
    failing) counts as failed; it never leaves the breaker waiting on it for good."""
    now = [0.0]
    br = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=lambda: now[0])
    br.on_failure(False)  # open
    now[0] = 11.0
    assert br.state == "half-open"
    tried = asyncio.Event()

    async def flaky() -> None:
        tried.set()
        raise ConnectionResetError("reset")

    slow = RetryPolicy(max_attempts=2, base_delay_s=3600, max_delay_s=3600)
    task = asyncio.ensure_future(call_with_retries(flaky, policy=slow, breaker=br, is_transient=lambda e: True,
                                                   what="t"))
    await asyncio.wait_for(tried.wait(), 10)
    await asyncio.sleep(0)  # into the backoff (a delay of up to an hour)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert br.state == "open"  # the probe failed: another cooldown ...
    now[0] = 22.0
    assert br.state == "half-open"  # ... after which the next call probes again


def test_backoff_is_bounded_jitter() -> None:
    pol = RetryPolicy(base_delay_s=0.1, max_delay_s=0.5)
    samples = [pol.backoff(n) for n in range(8) for _ in range(50)]
    assert all(0 <= s <= 0.5 for s in samples) and len(set(samples)) > 100


async def test_refresh_sees_other_nodes_and_ttl(tmp_path: Path) -> None:
    a = ObjectTier(LocalDirBackend(tmp_path))
    b = ObjectTier(LocalDirBackend(tmp_path))
    await a.open()
    await b.open()
    # both indexes built on the empty bucket first: otherwise b's first listing may already see
    # a's write below (a slow first run did), and the test is about refresh
    assert await a.wait_ready(10) and await b.wait_ready(10)
    k1, k2 = random_key(1, b"r"), random_key(2, b"r")
    r1, r2 = make_record(k1, 1), make_record(k2, 2)
    await a.write_many([(k1, memoryview(r1)), (k2, memoryview(r2))])
    assert not b.contains(k1)
    await b.refresh()
    assert b.contains(k1) and b.contains(k2)
    await a.delete(k1)  # local to a: the shared manifests are never changed by a delete
    await b.refresh()
    assert not a.contains(k1) and b.contains(k1) and b.contains(k2)
    buf = bytearray(len(r2))
    assert await b.read_into(k2, memoryview(buf)) == len(r2) and bytes(buf) == r2
    expired = ObjectTier(LocalDirBackend(tmp_path), ttl_s=0.0)
    await expired.open()
    assert expired.usage().num_blocks == 0  # everything is older than a zero TTL
    for t in (a, b, expired):
        await t.close()


async def test_unreachable_store_degrades_to_misses() -> None:
    b = S3Backend("bkt", endpoint_url="http://127.0.0.1:9", access_key="a", secret_key="b",
                  retry=RetryPolicy(max_attempts=1, attempt_timeout_s=2), connect_timeout_s=1)
    tier = ObjectTier(b)
    await asyncio.wait_for(tier.open(), 1)  # returns at once; the index builds in the background
    assert not await tier.wait_ready(5)  # the build keeps failing (and retrying): misses meanwhile
    assert not tier.available and not tier.index_ready and tier.usage().num_blocks == 0
    assert await tier.read_into(random_key(1), memoryview(bytearray(4096))) is None
    with pytest.raises(TierUnavailable):
        await asyncio.wait_for(tier.write(random_key(1), memoryview(make_record(random_key(1)))), 30)
    await tier.close()


async def test_multipart_from_memory_reuses_part_buffers(moto_s3: S3Server) -> None:
    b = S3Backend(unique_bucket("mp"), part_bytes=5 << 20, max_concurrency=2, **moto_s3.backend_kwargs())
    await b.open()
    try:
        blobs = [_payload((11 << 20) + 123, seed=s) for s in (1, 2, 3)]
        await asyncio.gather(*(b.put_object(f"o{i}", memoryview(x)) for i, x in enumerate(blobs)))
        assert 0 < len(b._buffers) <= 4  # full-size part buffers came back for reuse
        for i, x in enumerate(blobs):
            assert await b.get_bytes(f"o{i}") == x  # reused buffers never mixed parts up
    finally:
        await b.close()
