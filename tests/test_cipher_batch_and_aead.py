"""The record cipher's fast paths: a seal into a buffer with room for the tag is one AEAD call of
a standard AES-256-GCM (any GCM implementation opens it), and a batch looks each tenant's key up
once while keeping every check of the per-record calls (missing key, erasure, nonces)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import aes_key_unwrap

from dynamo_tiered_kv.tenants import cipher as cipher_module
from dynamo_tiered_kv.tenants.cipher import TAG_BYTES, RecordCipher, TenantKeyUnavailable

T1 = bytes.fromhex("0102030405060708")
T2 = bytes.fromhex("1112131415161718")
K1, K2 = bytes([0xA1]) * 32, bytes([0xB2]) * 32


def payload(n: int, seed: int = 1) -> bytearray:
    return bytearray((i * 31 + seed) % 251 for i in range(n))


class CountingKeys:
    """A tenant-key callable over a dict that counts its calls."""

    def __init__(self, keys: dict[bytes, bytes]) -> None:
        self.keys = keys
        self.calls = 0

    def __call__(self, tenant: bytes, create: bool) -> bytes | None:
        self.calls += 1
        return self.keys.get(tenant)


def _gcm_parts(key: bytes, tenant: bytes, aad: bytes, seal: bytes) -> tuple[AESGCM, bytes, bytes, bytes]:
    """(AEAD of the seal's DEK, nonce, tag, the full associated data) as docs/ENCRYPTION.md states them."""
    dek = aes_key_unwrap(key, seal[12:52])
    return AESGCM(dek), seal[52:64], seal[64:80], b"dtkv record 1\x00" + tenant + seal[:52] + aad


@pytest.mark.parametrize("n", [1, 16, 4096, 135_168])
def test_a_seal_with_room_for_the_tag_is_one_aead_call_of_standard_gcm(n: int, monkeypatch) -> None:
    cipher = RecordCipher(lambda tenant, create: K1)
    plain = payload(n)
    out = bytearray(b"\xee" * (n + TAG_BYTES + 5))

    def no_context(*args: object, **kwargs: object) -> None:
        raise AssertionError("a GCM context was built for a seal that has room for its tag")

    monkeypatch.setattr(cipher_module, "Cipher", no_context)
    seal = cipher.seal(T1, b"aad", memoryview(plain), out=memoryview(out))
    monkeypatch.undo()
    assert bytes(out[n + TAG_BYTES:]) == b"\xee" * 5, "wrote past the payload and the tag's 16 bytes"
    assert seal[64:80] == bytes(out[n : n + TAG_BYTES])
    aead, nonce, tag, full_aad = _gcm_parts(K1, T1, b"aad", seal)
    assert aead.decrypt(nonce, bytes(out[:n]) + tag, full_aad) == plain  # plain AES-256-GCM
    ct = bytearray(out[:n])
    assert cipher.open(T1, b"aad", ct, seal) and ct == plain  # and the usual open reads it


@pytest.mark.parametrize("room", [0, 3, TAG_BYTES])
def test_every_seal_path_writes_the_same_format(room: int) -> None:
    """In place, into an exact buffer, into one with a little room, into one with room for the tag:
    each opens with a plain GCM over the documented associated data."""
    cipher = RecordCipher(lambda tenant, create: K1)
    plain = payload(1000)
    in_place = bytearray(plain)
    seals = [(cipher.seal(T1, b"x", in_place), bytes(in_place))]
    out = bytearray(1000 + room)
    seals.append((cipher.seal(T1, b"x", bytearray(plain), out=out), bytes(out[:1000])))
    for seal, ct in seals:
        aead, nonce, tag, full_aad = _gcm_parts(K1, T1, b"x", seal)
        assert aead.decrypt(nonce, ct + tag, full_aad) == plain
    assert seals[0][0][52:64] != seals[1][0][52:64]  # one DEK, a counter: never the same nonce


def test_an_out_shorter_than_the_payload_is_refused_before_a_nonce_is_spent() -> None:
    cipher = RecordCipher(lambda tenant, create: K1)
    with pytest.raises(ValueError, match="at least as long"):
        cipher.seal(T1, b"", bytearray(100), out=bytearray(99))
    assert int.from_bytes(cipher.seal(T1, b"", bytearray(4))[52:64], "big") == 0


def test_a_batch_looks_each_tenant_key_up_once_and_opens_the_same() -> None:
    keys = CountingKeys({T1: K1, T2: K2})
    cipher = RecordCipher(keys)
    batch = cipher.batch()
    bufs = [payload(256, seed=i) for i in range(20)]
    seals = [batch.seal(T1 if i % 2 else T2, b"a", b) for i, b in enumerate(bufs)]
    assert keys.calls == 2  # one lookup per tenant (create) for 20 seals
    reader = cipher.batch()
    assert all(reader.open(T1 if i % 2 else T2, b"a", b, s) for i, (b, s) in enumerate(zip(bufs, seals)))
    assert keys.calls == 4  # and one per tenant (read) for 20 opens
    assert all(b == payload(256, seed=i) for i, b in enumerate(bufs))
    nonces = {(s[12:52], s[52:64]) for s in seals}
    assert len(nonces) == len(seals)  # batches share the cipher's counters


def test_a_batch_keeps_the_misses_and_a_new_batch_sees_an_erase() -> None:
    keys = CountingKeys({T1: K1})
    cipher = RecordCipher(keys)
    buf = payload(64)
    seal = cipher.batch().seal(T1, b"", buf)
    batch = cipher.batch()
    with pytest.raises(TenantKeyUnavailable):
        batch.seal(T2, b"", bytearray(8))  # a tenant without a key: nothing stored in the clear
    assert not batch.open(T1, b"", bytearray(buf), seal[:-1])  # a malformed seal
    keys.keys.pop(T1)  # erased: the next batch looks the key up again and finds none
    ct = bytearray(buf)
    assert not cipher.batch().open(T1, b"", ct, seal) and ct == buf


def test_an_open_with_lent_room_is_one_aead_call_and_gives_the_bytes_back(monkeypatch) -> None:
    cipher = RecordCipher(lambda tenant, create: K1)
    plain = payload(5000)
    sealed = bytearray(plain)
    seal = cipher.seal(T1, b"a", sealed)
    lent = b"next record's head"[:TAG_BYTES]

    def no_context(*args: object, **kwargs: object) -> None:
        raise AssertionError("a GCM context was built for an open that has room for its tag")

    monkeypatch.setattr(cipher_module, "Cipher", no_context)
    buf = bytearray(sealed) + bytearray(lent)
    assert cipher.batch().open(T1, b"a", memoryview(buf), seal, lent=TAG_BYTES)
    assert buf[:5000] == plain and buf[5000:] == lent
    bad = bytearray(sealed) + bytearray(lent)
    bad[10] ^= 1
    assert not cipher.open(T1, b"a", bad, seal, lent=TAG_BYTES)
    assert bad[:5000] == bytearray(5000) and bad[5000:] == lent  # zeroed, and the lent bytes back
    with pytest.raises(ValueError, match="lent"):
        cipher.open(T1, b"a", bytearray(8), seal, lent=9)


def test_an_aead_that_refuses_the_lent_buffers_falls_back_to_the_context() -> None:
    """A ``cryptography`` release that will not decrypt over its own input: the open still succeeds
    (GCM context), and the lent bytes hold what they held."""
    cipher = RecordCipher(lambda tenant, create: K1)
    plain = payload(3000)
    sealed = bytearray(plain)
    seal = cipher.seal(T1, b"", sealed)

    class Refusing:
        def decrypt_into(self, *args: object) -> int:
            raise ValueError("buffers overlap")

    buf = bytearray(sealed) + bytearray(b"L" * TAG_BYTES)
    assert cipher.batch().open(T1, b"", buf, seal, lent=TAG_BYTES)  # warms the DEK cache
    dek = next(iter(cipher._deks.values()))
    object.__setattr__(dek, "aead", Refusing())  # a frozen dataclass: this test alone changes it
    buf = bytearray(sealed) + bytearray(b"L" * TAG_BYTES)
    assert cipher.open(T1, b"", buf, seal, lent=TAG_BYTES)
    assert buf[:3000] == plain and buf[3000:] == b"L" * TAG_BYTES
