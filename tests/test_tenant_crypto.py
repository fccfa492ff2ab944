"""Encryption at rest with per-tenant keys: KEK sources, the wrapped tenant-key store (shared by
nodes through one directory or bucket), and the record cipher (seal/open in place)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.keywrap import aes_key_unwrap
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.errors import ConfigError
from dynamo_tiered_kv.tenants import cipher as cipher_module
from dynamo_tiered_kv.tenants.cipher import (
    NONCE_BYTES,
    SEAL_BYTES,
    RecordCipher,
    TenantKeyUnavailable,
    key_ref,
)
from dynamo_tiered_kv.tenants.kek import KeySource
from dynamo_tiered_kv.tenants.keystore import KeyObjects, TenantKeyStore, TenantKeyUnreadable
from dynamo_tiered_kv.testing.clock import ManualClock
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, S3Backend

pytest_plugins = ["infra.fixtures_s3"]

T1 = bytes.fromhex("0102030405060708")
T2 = bytes.fromhex("1112131415161718")
K1, K2, K3 = (bytes([i]) * 32 for i in (0xA1, 0xB2, 0xC3))


def b64(k: bytes) -> str:
    return base64.b64encode(k).decode()


# --- plumbing: a loop in its own thread, as the store runs its I/O --------------------------------


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)
    lp.close()


def on(loop: asyncio.AbstractEventLoop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


def keysource(**versions: bytes) -> KeySource:
    current = versions.pop("current_", None)
    return KeySource(versions, current)  # type: ignore[arg-type]


def fixed_keys(keys: dict[bytes, bytes]):
    """A tenant-key callable over a dict (creates nothing)."""
    return lambda tenant, create: keys.get(tenant)


def payload(n: int, seed: int = 1) -> bytearray:
    return bytearray((i * 31 + seed) % 251 for i in range(n))


# --- KEK sources ----------------------------------------------------------------------------------


def test_kek_sources_file_json_env_and_dir_read_the_same_keys(tmp_path: Path, monkeypatch) -> None:
    text = f"# KEKs\nv1={b64(K1)}\nv2 = {b64(K2)}  # newest\ncurrent=v2\n"
    (tmp_path / "keks.txt").write_text(text)
    (tmp_path / "keks.json").write_text(json.dumps({"current": "v2", "keys": {"v1": b64(K1), "v2": b64(K2)}}))
    d = tmp_path / "secret"
    d.mkdir()
    (d / "v1").write_text(b64(K1) + "\n")
    (d / "v2").write_bytes(K2)  # a Secret's `data` value is mounted as the raw bytes
    (d / "current").write_text("v2\n")
    (d / "..data").mkdir()  # what Kubernetes adds next to the keys
    monkeypatch.setenv("DTKV_TENANT_KEKS", f"v1={b64(K1)};v2={b64(K2)},current=v2")
    sources = [KeySource.from_file(tmp_path / "keks.txt"), KeySource.from_file(tmp_path / "keks.json"),
               KeySource.from_dir(d), KeySource.from_env(),
               KeySource.from_env("X", environ={"X": json.dumps({"current": "v2", "keys": {"v1": b64(K1),
                                                                                           "v2": b64(K2)}})})]
    for src in sources:
        assert src.current == "v2" and src.versions() == ("v1", "v2"), src
        assert src.get("v1") == K1 and src.current_key() == ("v2", K2) and src.get("v3") is None


def test_kek_single_version_is_current_and_reload_follows_the_origin(tmp_path: Path) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    (d / "v1").write_text(b64(K1))
    src = KeySource.from_dir(d)
    assert src.current == "v1"
    (d / "v2").write_text(b64(K2))
    (d / "current").write_text("v2")
    src.reload()
    assert src.current_key() == ("v2", K2) and src.get("v1") == K1
    (d / "current").write_text("v9")  # a broken update keeps the keys in use
    with pytest.raises(ConfigError, match="v9"):
        src.reload()
    assert src.current_key() == ("v2", K2)


SECRET_TEXT = b64(b"\x5a" * 16)  # a too-short key whose text must never show up


@pytest.mark.parametrize(("text", "match"), [
    (f"v1={SECRET_TEXT}", "decodes to 16 bytes"),
    (f"v1={b64(K1)[:-2]}!!", "not valid base64"),
    (f"v1={b64(K1)}\nv2={b64(K2)}", "no current KEK version"),
    (f"v1={b64(K1)}\ncurrent=v2", "current KEK version 'v2' has no key"),
    (f"v1={b64(K1)}\nv1={b64(K2)}\ncurrent=v1", "given twice"),
    (f"bad/name={b64(K1)}", "invalid KEK version id"),
    (f"{b64(K1)}", "invalid KEK version id"),  # a bare key: its padding '=' reads as an entry
    (f"{b64(K1).rstrip('=')}", "not '<version>=<base64 key>'"),
    (f"{b64(K1)}=v1", "invalid KEK version id"),
    ("# nothing but a comment\n", "no KEK versions"),
    ('{"keys": {"v1": "' + SECRET_TEXT + '"}, "current": "v1"}', "decodes to 16 bytes"),
    ('{"keys": ["' + SECRET_TEXT + '"]}', "expected"),
    ('{"keys": {"v1": "' + SECRET_TEXT, "not valid JSON"),
])
def test_kek_malformed_material_is_refused_without_echoing_it(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "keks"
    f.write_text(text)
    for make in (lambda: KeySource.from_file(f), lambda: KeySource.from_env("K", environ={"K": text}),
                 lambda: KeySource.from_text(text)):
        with pytest.raises(ConfigError, match=match) as info:
            make()
        shown = "".join(traceback.format_exception(info.value))
        for secret in (SECRET_TEXT, b64(K1), b64(K2), b64(K1)[:-2]):
            assert secret not in shown


def test_kek_bad_directory_and_missing_origins(tmp_path: Path) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    (d / "v1").write_bytes(b"\x01" * 31)
    with pytest.raises(ConfigError, match="KEK version 'v1'") as info:
        KeySource.from_dir(d)
    assert "\\x01" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot read KEK directory"):
        KeySource.from_dir(tmp_path / "absent")
    with pytest.raises(ConfigError, match="cannot read KEK file"):
        KeySource.from_file(tmp_path / "absent")
    with pytest.raises(ConfigError, match="unset or empty"):
        KeySource.from_env("K", environ={})
    with pytest.raises(ConfigError, match="is 16 bytes"):
        KeySource({"v1": b"x" * 16})


def test_no_key_bytes_in_repr_str_or_logs(tmp_path: Path, loop, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    src = KeySource({"v1": K1})
    ks = TenantKeyStore(LocalDirBackend(tmp_path), src)
    key = on(loop, ks.get_or_create(T1))
    cipher = RecordCipher(ks.lookup(loop))
    buf = payload(100)
    cipher.seal(T1, b"", buf)
    on(loop, ks.erase(T1))
    assert not cipher.open(T1, b"", buf, bytes(SEAL_BYTES))
    shown = repr(src) + str(src) + repr(ks) + repr(cipher) + caplog.text
    for secret in (K1, key):
        for form in (b64(secret), secret.hex(), repr(secret)):
            assert form not in shown
    assert "v1" in repr(src)


# --- the record cipher ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 4096, (1 << 20) + 3])
def test_seal_then_open_round_trips_in_place(n: int) -> None:
    cipher = RecordCipher(fixed_keys({T1: K1}))
    plain = payload(n)
    buf = bytearray(plain)
    seal = cipher.seal(T1, b"record-aad", buf)
    assert len(seal) == SEAL_BYTES
    assert n < 16 or buf != plain  # encrypted in place
    assert cipher.open(T1, b"record-aad", buf, seal) and buf == plain
    other = RecordCipher(fixed_keys({T1: K1}))  # another process with the same tenant key
    buf2 = bytearray(plain)
    seal2 = other.seal(T1, b"record-aad", buf2)
    assert cipher.open(T1, b"record-aad", buf2, seal2) and buf2 == plain


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100_003])
def test_both_in_place_paths_write_the_same_ciphertext(n: int, monkeypatch) -> None:
    """Releases of ``cryptography`` that want spare output bytes take the tail path; its output
    opens on the direct path."""
    cipher = RecordCipher(fixed_keys({T1: K1}))
    buf = payload(n)
    monkeypatch.setattr(cipher_module, "_EXACT_IN_PLACE", False)
    seal = cipher.seal(T1, b"", buf)
    monkeypatch.setattr(cipher_module, "_EXACT_IN_PLACE", True)
    assert cipher.open(T1, b"", buf, seal) and buf == payload(n)
    seal = cipher.seal(T1, b"", buf)
    monkeypatch.setattr(cipher_module, "_EXACT_IN_PLACE", False)
    assert cipher.open(T1, b"", buf, seal) and buf == payload(n)


def test_open_accepts_a_typed_view_of_the_payload() -> None:
    cipher = RecordCipher(fixed_keys({T1: K1}))
    plain = payload(4096)
    buf = bytearray(plain)
    seal = cipher.seal(T1, b"", memoryview(buf).cast("H"))  # e.g. a float16 tensor's memory
    assert cipher.open(T1, b"", memoryview(buf).cast("I"), seal) and buf == plain
    with pytest.raises(TypeError, match="writable"):
        cipher.seal(T1, b"", bytes(16))  # type: ignore[arg-type]


def _sealed(n: int = 1000) -> tuple[RecordCipher, bytearray, bytearray, bytes]:
    cipher = RecordCipher(fixed_keys({T1: K1, T2: K2}))
    plain = payload(n)
    buf = bytearray(plain)
    return cipher, plain, buf, cipher.seal(T1, b"aad", buf)


@pytest.mark.parametrize("where", ["format", "reserved", "ref", "wrapped", "nonce", "tag", "payload"])
def test_tampering_with_any_byte_fails_and_no_plaintext_is_left(where: str) -> None:
    cipher, plain, buf, seal = _sealed()
    at = {"format": 0, "reserved": 2, "ref": 5, "wrapped": 20, "nonce": 60, "tag": 70, "payload": None}[where]
    bad = bytearray(seal)
    if at is None:
        buf[500] ^= 0x01
    else:
        bad[at] ^= 0x01
    assert not cipher.open(T1, b"aad", buf, bytes(bad))
    assert buf != plain and plain[:400] not in bytes(buf)  # ciphertext still, or zeroed
    if where in ("nonce", "tag", "payload"):
        assert buf == bytearray(len(buf))  # it ran the decryption: zeroed, not unauthenticated text


def test_wrong_aad_tenant_or_seal_length_fails() -> None:
    cipher, plain, buf, seal = _sealed()
    ct = bytes(buf)
    for tenant, aad, s in ((T1, b"other", seal), (T2, b"aad", seal), (T1, b"aad", seal[:-1]),
                           (T1, b"aad", seal + b"\0")):
        buf[:] = ct
        assert not cipher.open(tenant, aad, buf, s)
        assert buf != plain
    with pytest.raises(ValueError, match="8 bytes"):
        cipher.open(b"short", b"aad", buf, seal)
    buf[:] = ct
    assert cipher.open(T1, b"aad", buf, seal) and buf == plain


def test_a_missing_or_different_tenant_key_fails() -> None:
    keys = {T1: K1}
    writer = RecordCipher(fixed_keys(keys))
    plain = payload(2000)
    buf = bytearray(plain)
    seal = writer.seal(T1, b"", buf)
    ct = bytes(buf)
    assert not RecordCipher(fixed_keys({})).open(T1, b"", buf, seal)  # no key
    assert not RecordCipher(fixed_keys({T1: K2})).open(T1, b"", buf, seal)  # a re-created tenant's key
    assert bytes(buf) == ct
    keys.pop(T1)  # erased under the writer: its cached DEKs are no use any more
    assert not writer.open(T1, b"", buf, seal)
    with pytest.raises(TenantKeyUnavailable):
        writer.seal(T1, b"", buf)
    assert bytes(buf) == ct  # nothing encrypted (again) on a refused seal
    keys[T1] = K3
    assert not writer.open(T1, b"", buf, seal)
    assert writer.seal(T1, b"", bytearray(10))[4:12] == key_ref(K3)


def test_a_failing_key_callable_is_a_miss_not_an_error() -> None:
    def broken(tenant: bytes, create: bool) -> bytes | None:
        raise OSError("key store down")

    _cipher, _plain, buf, seal = _sealed()
    assert not RecordCipher(broken).open(T1, b"aad", buf, seal)
    with pytest.raises(TenantKeyUnavailable):
        RecordCipher(broken).seal(T1, b"aad", buf)


def _dek_nonce(key: bytes, seal: bytes) -> tuple[bytes, bytes]:
    return aes_key_unwrap(key, seal[12:52]), seal[52:52 + NONCE_BYTES]


def test_nonces_never_repeat_across_threads_instances_and_restarts() -> None:
    per_thread, threads = 1500, 6
    ciphers = [RecordCipher(fixed_keys({T1: K1})) for _ in range(2)]  # two processes
    seals: list[bytes] = []
    lock = threading.Lock()

    def write(cipher: RecordCipher) -> None:
        mine = [cipher.seal(T1, b"", bytearray(8)) for _ in range(per_thread)]
        with lock:
            seals.extend(mine)

    workers = [threading.Thread(target=write, args=(ciphers[i % 2],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    restarted = RecordCipher(fixed_keys({T1: K1}))  # a restart: the counter starts over, the DEK is new
    seals += [restarted.seal(T1, b"", bytearray(8)) for _ in range(100)]
    pairs = [_dek_nonce(K1, s) for s in seals]
    assert len(pairs) == per_thread * threads + 100
    assert len(set(pairs)) == len(pairs)
    deks = {d for d, _ in pairs}
    assert len(deks) == 3  # one per instance: fresh per process
    nonces = sorted(int.from_bytes(n, "big") for d, n in pairs if d == pairs[0][0])
    assert nonces == list(range(len(nonces)))  # a counter, not random


def test_a_used_up_dek_is_replaced_and_old_records_still_open() -> None:
    cipher = RecordCipher(fixed_keys({T1: K1}), records_per_dek=5)
    bufs = [payload(64, seed=i) for i in range(12)]
    seals = [cipher.seal(T1, b"", b) for b in bufs]
    pairs = [_dek_nonce(K1, s) for s in seals]
    assert len({d for d, _ in pairs}) == 3 and len(set(pairs)) == 12
    assert [int.from_bytes(n, "big") for _, n in pairs] == [0, 1, 2, 3, 4] * 2 + [0, 1]
    fresh = RecordCipher(fixed_keys({T1: K1}), dek_cache=1)  # evicts and unwraps again
    for i, (b, s) in enumerate(zip(bufs, seals)):
        assert fresh.open(T1, b"", b, s) and b == payload(64, seed=i)
    with pytest.raises(ValueError):
        RecordCipher(fixed_keys({}), records_per_dek=2**31 + 1)


# --- the tenant-key store -------------------------------------------------------------------------


@pytest.fixture(params=["localdir", "moto_s3"])
def shared(request: pytest.FixtureRequest, tmp_path: Path):
    """Makes backends that share one store (a directory, or a bucket on a moto server)."""
    if request.param == "localdir":
        return lambda: LocalDirBackend(tmp_path / "keys")
    server: S3Server = request.getfixturevalue("moto_s3")
    bucket = unique_bucket("keys")
    return lambda: S3Backend(bucket, "kv/", **server.backend_kwargs())


def test_get_or_create_is_race_safe_across_nodes(shared, loop) -> None:
    async def race() -> list[bytes]:
        nodes = []
        for _ in range(4):
            b = shared()
            await b.open()
            nodes.append(TenantKeyStore(b, KeySource({"v1": K1})))
        keys = await asyncio.gather(*(n.get_or_create(T1) for n in nodes for _ in range(3)))
        again = await TenantKeyStore(nodes[0]._objects, KeySource({"v1": K1})).get(T1)
        for n in nodes:
            await n._objects.close()
        return [*keys, again]

    keys = on(loop, race())
    assert len(set(keys)) == 1 and len(keys[0]) == 32


def test_a_key_this_node_cannot_unwrap_is_never_replaced(tmp_path: Path, loop) -> None:
    a = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1}))
    key = on(loop, a.get_or_create(T1))
    obj = tmp_path / a.object_name(T1)
    before = obj.read_bytes()
    for wrong in (KeySource({"v1": K2}), KeySource({"v2": K1})):  # other material; other version
        b = TenantKeyStore(LocalDirBackend(tmp_path), wrong)
        assert on(loop, b.get(T1)) is None
        with pytest.raises(TenantKeyUnreadable):
            on(loop, b.get_or_create(T1))
    assert obj.read_bytes() == before and on(loop, a.get(T1)) == key
    obj.write_bytes(before.replace(b'"format": 1', b'"format": 2'))
    a.forget()
    assert on(loop, a.get(T1)) is None


def test_rotation_rewraps_every_key_and_the_old_kek_can_go(tmp_path: Path, loop) -> None:
    old = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1}))
    k1, k2 = on(loop, old.get_or_create(T1)), on(loop, old.get_or_create(T2))
    sealed = []
    cipher = RecordCipher(old.lookup(loop))
    for t in (T1, T2):
        buf = payload(300)
        sealed.append((t, buf, cipher.seal(t, b"", buf)))

    both = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1, "v2": K2}, "v2"))
    assert on(loop, both.get(T1)) == k1  # reads the copy under the old version
    report = on(loop, both.rotate())
    assert report.version == "v2" and report.rewrapped == [T1, T2] and not report.unreadable
    for t in (T1, T2):
        copies = json.loads((tmp_path / both.object_name(t)).read_bytes())["copies"]
        assert set(copies) == {"v2"}
    assert on(loop, both.rotate()).already_current == [T1, T2]

    new = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v2": K2}))  # v1 removed
    assert on(loop, new.get(T1)) == k1 and on(loop, new.get(T2)) == k2
    reader = RecordCipher(new.lookup(loop))
    for t, buf, seal in sealed:
        assert reader.open(t, b"", buf, seal) and buf == payload(300)
    t3 = bytes(range(8))
    on(loop, new.get_or_create(t3))
    assert set(json.loads((tmp_path / new.object_name(t3)).read_bytes())["copies"]) == {"v2"}
    assert on(loop, old.get(t3)) is None  # a node still on v1 only cannot read keys made under v2
    assert on(loop, new.tenants()) == sorted([T1, T2, t3])


def test_erase_stops_other_nodes_within_key_cache_s(tmp_path: Path, loop) -> None:
    clock = ManualClock(1000.0)
    a = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1}), key_cache_s=60, clock=clock)
    b = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1}), key_cache_s=60, clock=clock)
    writer, reader = RecordCipher(a.lookup(loop)), RecordCipher(b.lookup(loop))
    plain = payload(5000)
    buf = bytearray(plain)
    seal = writer.seal(T1, b"", buf)
    ct = bytes(buf)
    assert reader.open(T1, b"", buf, seal) and buf == plain  # b now caches the key
    old_key = b.cached(T1)
    assert on(loop, a.erase(T1))
    assert not (tmp_path / a.object_name(T1)).exists()
    buf[:] = ct
    assert not writer.open(T1, b"", buf, seal)  # the erasing node stops at once
    clock.t += 20  # within the bound, b still has the key cached (no refresh before half of it)
    assert reader.open(T1, b"", buf, seal)
    clock.t += 41  # past key_cache_s since b read the key
    buf[:] = ct
    assert not reader.open(T1, b"", buf, seal) and bytes(buf) == ct
    assert b.cached(T1) is None
    assert on(loop, b.get_or_create(T1)) != old_key  # the tenant again: a new key generation
    assert not reader.open(T1, b"", buf, seal)


def test_a_cached_key_is_refreshed_ahead_of_expiry_and_sees_an_erase(tmp_path: Path, loop) -> None:
    clock = ManualClock(0.0)
    a = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1}), clock=clock)
    b = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1}), key_cache_s=60, clock=clock)
    on(loop, a.get_or_create(T1))
    lookup = b.lookup(loop)
    assert lookup(T1, False) is not None
    on(loop, a.erase(T1))
    clock.t = 31  # past half of key_cache_s: answered from the cache, refreshed in the background
    assert lookup(T1, False) is not None
    deadline = time.monotonic() + 10
    while b.cached(T1) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.cached(T1) is None and lookup(T1, False) is None


class HangingObjects:
    """A key store that never answers."""

    async def put_object(self, name: str, source: bytes, *, if_absent: bool = False) -> bool:
        await asyncio.sleep(3600)
        return False

    async def get_bytes(self, name: str) -> bytes | None:
        await asyncio.sleep(3600)
        return None

    async def delete(self, name: str) -> bool:
        return False

    async def list(self, prefix: str = "") -> list:
        return []


def test_a_hung_key_store_is_a_miss_within_the_timeout(loop) -> None:
    objects: KeyObjects = HangingObjects()
    ks = TenantKeyStore(objects, KeySource({"v1": K1}))
    cipher = RecordCipher(ks.lookup(loop, timeout_s=0.3))
    _c, plain, buf, seal = _sealed()
    t0 = time.monotonic()
    assert not cipher.open(T1, b"aad", buf, seal)
    with pytest.raises(TenantKeyUnavailable):
        cipher.seal(T1, b"aad", bytearray(plain))
    assert time.monotonic() - t0 < 0.6 + 2.0


def test_lookup_on_the_loop_thread_never_waits(tmp_path: Path, loop) -> None:
    ks = TenantKeyStore(LocalDirBackend(tmp_path), KeySource({"v1": K1}))
    lookup = ks.lookup(loop, timeout_s=30)

    async def on_loop() -> bytes | None:
        return lookup(T1, True)  # would deadlock if it waited for the loop it runs on

    assert on(loop, on_loop()) is None
    deadline = time.monotonic() + 10
    while ks.cached(T1) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ks.cached(T1) is not None and lookup(T1, False) == ks.cached(T1)
    assert os.path.exists(tmp_path / ks.object_name(T1))
