"""Sealed records (blocks/sealed.py): sealing and opening give back the plain record byte for byte,
a sealed record's header still verifies (recovery, fsck, quarantine checks keep working), no
decode path ever hands a sealed payload to the engine, and any changed byte fails to open."""

from __future__ import annotations

import numpy as np
import pytest
from test_record_tenant import NS, T1, _encode, _layout

from dynamo_tiered_kv._native import fast
from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.sealed import is_sealed, open_record, seal_record, seal_room
from dynamo_tiered_kv.errors import RecordSealed
from dynamo_tiered_kv.tenants.cipher import SEAL_BYTES, RecordCipher

KEY = bytes(range(32))


def _cipher() -> RecordCipher:
    return RecordCipher(lambda tenant, create: KEY)


def _sealed() -> tuple[np.ndarray, np.ndarray, list[bytes], int]:
    src, buf, keys = _encode(T1)
    plain = buf.copy()
    rb = codec.record_bytes(src.shape)
    c = _cipher()
    for i in range(3):
        seal_record(buf[i * rb : (i + 1) * rb], c, SEAL_BYTES)
    return plain, buf, keys, rb


def test_seal_then_open_gives_back_the_plain_record() -> None:
    plain, buf, _, rb = _sealed()
    hb = codec.header_bytes(3)
    for i in range(3):
        rec = buf[i * rb : (i + 1) * rb]
        assert is_sealed(rec) and not np.array_equal(rec[hb:], plain[i * rb + hb : (i + 1) * rb])
        hdr = codec.verify_record(rec, key=None)  # header and identity still verify
        assert hdr.sealed and hdr.tenant == T1
        assert open_record(rec, _cipher(), SEAL_BYTES)
    assert np.array_equal(buf, plain)
    assert open_record(buf[:rb], _cipher(), SEAL_BYTES)  # a plain record is left as it is


@pytest.mark.parametrize("native", [True, False])
def test_no_decode_path_serves_a_sealed_payload(native: bool, monkeypatch) -> None:
    if native and not fast.AVAILABLE:
        pytest.skip("compiled codec not built")
    if not native:
        monkeypatch.setattr(fast, "AVAILABLE", False)
    _, buf, keys, rb = _sealed()
    dst = _layout(2)
    before = [np.asarray(v).copy() for v in dst.layer_views]
    errs = codec.decode_blocks(buf, dst, [3, 4, 5], namespace=NS.digest, keys=keys)
    assert all(isinstance(e, RecordSealed) for e in errs)
    if not native:  # the pure-Python path refuses before copying anything
        assert all(np.array_equal(np.asarray(v), b) for v, b in zip(dst.layer_views, before, strict=True))
    with pytest.raises(RecordSealed):
        codec.payload_view(buf[:rb])
    with pytest.raises(RecordSealed):
        codec.decode_block(buf[:rb], dst, 0, namespace=NS.digest, key=keys[0])


def test_a_changed_byte_anywhere_fails_to_open() -> None:
    _, buf, _, rb = _sealed()
    hb, pb = codec.header_bytes(3), _layout(1).shape.payload_bytes
    seal_at = 128 + 8 * 3  # right after the layer checksum table
    # flags, namespace, key, tenant, checksum table, the seal, the payload (its padding is not content)
    for at in (10, 20, 40, 112, 130, seal_at + 5, seal_at + SEAL_BYTES - 1, hb + 7, hb + pb - 1):
        rec = buf[:rb].copy()
        rec[at] ^= 0x40
        assert not open_record(rec, _cipher(), SEAL_BYTES), f"a flip at byte {at} went unnoticed"


def test_another_tenants_key_does_not_open() -> None:
    _, buf, _, rb = _sealed()
    other = RecordCipher(lambda tenant, create: bytes(32))
    assert not open_record(buf[:rb].copy(), other, SEAL_BYTES)


def test_headers_too_full_for_a_seal_are_refused() -> None:
    assert seal_room(3, SEAL_BYTES) and seal_room(400, SEAL_BYTES)
    assert not seal_room(495, SEAL_BYTES)  # 128 + 8 * 495 = 4088 bytes: one page, 8 bytes left


def test_sealing_from_a_source_leaves_it_unchanged_and_opens_to_it() -> None:
    _, plain, _ = _encode(T1, 1)
    before = plain.copy()
    out = np.full_like(plain, 0xAB)  # whatever the buffer held before
    seal_record(out, _cipher(), SEAL_BYTES, src=plain)
    assert np.array_equal(plain, before), "the staging slab was changed"
    assert is_sealed(out) and open_record(out, _cipher(), SEAL_BYTES)
    assert np.array_equal(out, before)
