"""What keeps sealed records cheap, as structure (no timing): a record is opened in the caller's own
buffer (no copy), sealing from a source uses no more than its 16 bytes of scratch, and the sealed
tier reuses its sealed-copy buffers across write batches instead of faulting in fresh memory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from test_record_tenant import T1, _encode

from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.sealed import is_sealed, open_record, seal_record
from dynamo_tiered_kv.tenants import sealed_tier as sealed_tier_module
from dynamo_tiered_kv.tenants.cipher import SEAL_BYTES, TAG_BYTES, RecordCipher
from dynamo_tiered_kv.tenants.sealed_tier import SEAL_AHEAD, SealedTier
from dynamo_tiered_kv.testing.records import make_record
from dynamo_tiered_kv.tiers.ssd import SSDTier

KEY = bytes(range(32))


def _cipher() -> RecordCipher:
    return RecordCipher(lambda tenant, create: KEY)


class SpyCipher:
    """Forwards to a cipher and records the payload buffers ``open`` was handed."""

    def __init__(self, inner: RecordCipher) -> None:
        self.inner = inner
        self.opened: list[tuple[memoryview, int]] = []

    def seal(self, tenant: bytes, aad: bytes, payload: memoryview, out: memoryview | None = None) -> bytes:
        return self.inner.seal(tenant, aad, payload, out)

    def open(self, tenant: bytes, aad: bytes, payload: memoryview, seal: bytes, *, lent: int = 0) -> bool:
        self.opened.append((payload, lent))
        return self.inner.open(tenant, aad, payload, seal, lent=lent)


def test_a_record_is_decrypted_in_the_callers_buffer_without_a_copy() -> None:
    src, plain, _ = _encode(T1, 2)
    rb = codec.record_bytes(src.shape)
    slab = plain.copy()
    for i in range(2):
        seal_record(slab[i * rb : (i + 1) * rb], _cipher(), SEAL_BYTES)
    spy = SpyCipher(_cipher())
    hb, pb = codec.header_bytes(3), src.shape.payload_bytes
    rec = slab[rb : 2 * rb]
    assert open_record(rec, spy, SEAL_BYTES)
    ((view, lent),) = spy.opened
    assert np.shares_memory(np.frombuffer(view, np.uint8), rec)
    assert np.frombuffer(view, np.uint8).ctypes.data == rec[hb:].ctypes.data and len(view) - lent == pb
    assert lent == TAG_BYTES  # this shape's padding after the payload is the tag's room: one AEAD call
    assert np.array_equal(rec, plain[rb : 2 * rb])


def test_sealing_from_a_source_uses_only_its_spare_bytes_and_opens_to_the_source() -> None:
    src, plain, _ = _encode(T1, 3)
    rb = codec.record_bytes(src.shape)
    assert rb > codec.header_bytes(3) + src.shape.payload_bytes  # this shape has padding after the payload
    before = plain.copy()
    buf = np.full(3 * rb + TAG_BYTES + 64, 0x5A, np.uint8)
    for i in range(3):  # back to back, in order: record i's scratch is the start of record i+1's slot
        seal_record(buf[i * rb : (i + 1) * rb + TAG_BYTES], _cipher(), SEAL_BYTES, src=plain[i * rb : (i + 1) * rb],
                    spare=TAG_BYTES)
    assert np.array_equal(plain, before), "the source was changed"
    assert np.all(buf[3 * rb + TAG_BYTES :] == 0x5A), "wrote past the spare bytes"
    for i in range(3):
        rec = buf[i * rb : (i + 1) * rb]
        assert is_sealed(rec) and codec.verify_record(rec, key=None).sealed  # the sealed header checks out
        assert open_record(rec, _cipher(), SEAL_BYTES)
    assert np.array_equal(buf[: 3 * rb], before)  # padding and all, byte for byte


async def test_write_batches_reuse_their_sealed_copy_buffers(tmp_path: Path, monkeypatch) -> None:
    made: list[int] = []
    real_aligned = sealed_tier_module._aligned

    def counting_aligned(nbytes: int) -> np.ndarray:
        made.append(nbytes)
        return real_aligned(nbytes)

    monkeypatch.setattr(sealed_tier_module, "_aligned", counting_aligned)
    tier = SealedTier(SSDTier(tmp_path, capacity_bytes=64 << 20, segment_bytes=4 << 20, idle_seal_s=None), _cipher())
    await tier.open()
    try:
        batches = 2 * SEAL_AHEAD  # more batches at once than the tier keeps sealed copies for
        for rnd in range(3):
            keys = [[bytes([rnd, b, j]) + bytes(13) for j in range(4)] for b in range(batches)]
            recs = [[make_record(k, 7, tenant=T1) for k in ks] for ks in keys]
            await asyncio.gather(*(tier.write_many([(k, memoryview(r)) for k, r in zip(ks, rs, strict=True)])
                                   for ks, rs in zip(keys, recs, strict=True)))
            for ks, rs in zip(keys, recs, strict=True):
                for k, r in zip(ks, rs, strict=True):
                    got = bytearray(len(r))
                    assert await tier.read_into(k, memoryview(got)) == len(r) and bytes(got) == r
        assert len(made) <= SEAL_AHEAD, f"{len(made)} sealed-copy buffers made for {3 * batches} batches"
    finally:
        await tier.close()


async def test_a_slab_read_opens_every_record_but_the_last_with_one_aead_call(tmp_path: Path, monkeypatch) -> None:
    from dynamo_tiered_kv.tenants import cipher as cipher_module

    contexts: list[object] = []
    real_cipher = cipher_module.Cipher

    def counting_cipher(*args: object, **kwargs: object) -> object:
        contexts.append(args)
        return real_cipher(*args, **kwargs)

    tier = SealedTier(SSDTier(tmp_path, capacity_bytes=64 << 20, segment_bytes=4 << 20, idle_seal_s=None), _cipher())
    await tier.open()
    try:
        keys = [bytes([9, j]) + bytes(14) for j in range(5)]
        recs = [make_record(k, j, tenant=T1) for j, k in enumerate(keys)]
        await tier.write_many([(k, memoryview(r)) for k, r in zip(keys, recs, strict=True)])
        rb = len(recs[0])
        slab = np.full(6 * rb, 0x77, np.uint8)  # one spare slot after the read: never touched
        monkeypatch.setattr(cipher_module, "Cipher", counting_cipher)
        got = await tier.read_slab(keys, slab[: 5 * rb], rb)
        assert got == [rb] * 5
        assert len(contexts) == 1  # the last record has no next slot to borrow from
        assert b"".join(recs) == slab[: 5 * rb].tobytes() and np.all(slab[5 * rb :] == 0x77)
    finally:
        await tier.close()


async def test_the_buffers_kept_are_the_largest_so_large_batches_stop_making_new_ones(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """A small write, then large writes of SEAL_AHEAD batches at once, again and again: once the
    large buffers exist none is made any more (the small buffer is the one let go)."""
    made: list[int] = []
    real_aligned = sealed_tier_module._aligned

    def counting_aligned(nbytes: int) -> np.ndarray:
        made.append(nbytes)
        return real_aligned(nbytes)

    monkeypatch.setattr(sealed_tier_module, "_aligned", counting_aligned)
    tier = SealedTier(SSDTier(tmp_path, capacity_bytes=256 << 20, segment_bytes=16 << 20, idle_seal_s=None),
                      _cipher())
    await tier.open()
    try:
        rec_len = len(make_record(bytes(16), 0, tenant=T1))
        per_large = (1 << 20) // rec_len + 1  # larger than the smallest buffer made (1 MiB)

        async def write(rnd: int, sizes: list[int]) -> None:
            batches = [[(bytes([rnd, b, j]) + bytes(13), make_record(bytes(16), j, tenant=T1)) for j in range(n)]
                       for b, n in enumerate(sizes)]
            await asyncio.gather(*(tier.write_many([(k, memoryview(r)) for k, r in batch]) for batch in batches))

        await write(0, [1])  # one small buffer
        await write(1, [per_large] * SEAL_AHEAD)  # the large ones
        after_first_large = len(made)
        for rnd in range(2, 5):
            await write(rnd, [per_large] * SEAL_AHEAD)
        assert len(made) == after_first_large, f"{len(made) - after_first_large} buffers made after the first"
    finally:
        await tier.close()
