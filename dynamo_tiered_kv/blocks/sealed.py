"""Sealed records: a record whose payload is encrypted for its tenant (docs/FORMAT.md section 2.2).

Sealing turns a plain record into a sealed one in place: it sets ``FLAG_SEALED`` in the header,
stores the cipher's seal (wrapped data key, nonce, tag; ``tenants.cipher``) right after the layer
checksum table, recomputes the header checksum, and encrypts the payload with the header as
associated data (fixed fields with the flag set, and the checksum table), so a payload moved under
another record's header, or a header with any field changed, does not open. Opening reverses it
exactly: the plain record comes back byte for byte, and the usual checks (header checksum, layer
checksums over the plaintext, identity) then run on it as on any record. The GCM tag does not
replace the layer checksums: it proves the bytes are the ones the tenant's writer sealed, the
checksums keep proving (as for plain records) that they are the engine's bytes, and keeping both
leaves one verify path for every record.

The cipher is any object with ``seal(tenant, aad, payload) -> bytes`` and ``open(tenant, aad,
payload, seal) -> bool`` (``tenants.cipher.RecordCipher``); this module knows no key.
"""

from __future__ import annotations

import struct
from typing import Protocol

import numpy as np
import xxhash

from ..errors import HeaderCorrupt
from .codec import _FIXED_BYTES, _HDR_SUM_OFF, _TABLE_OFF, FLAG_SEALED, MAGIC, header_bytes

_FLAGS = struct.Struct("<H")
_U64 = struct.Struct("<Q")


class Cipher(Protocol):
    def seal(self, tenant: bytes, aad: bytes, payload: memoryview, out: memoryview | None = None) -> bytes: ...

    def open(self, tenant: bytes, aad: bytes, payload: memoryview, seal: bytes) -> bool: ...


def _geometry(rec: np.ndarray) -> tuple[int, int, int]:
    """(num_layers, header_bytes, payload_bytes) of a record's header, checked only for bounds."""
    if rec.nbytes < _TABLE_OFF or bytes(rec[:8]) != MAGIC:
        raise HeaderCorrupt("not a record")
    nl = int.from_bytes(rec[68:72].tobytes(), "little")
    hb = int.from_bytes(rec[12:16].tobytes(), "little")
    pb = int.from_bytes(rec[96:104].tobytes(), "little")
    if nl <= 0 or nl > 65536 or hb != header_bytes(nl) or rec.nbytes < hb + pb:
        raise HeaderCorrupt("implausible record header")
    return nl, hb, pb


def is_sealed(rec: np.ndarray) -> bool:
    return rec.nbytes >= _FIXED_BYTES and bytes(rec[:8]) == MAGIC and bool(
        _FLAGS.unpack_from(rec, 10)[0] & FLAG_SEALED)


def _aad(rec: np.ndarray, nl: int) -> bytes:
    return bytes(rec[:_FIXED_BYTES]) + bytes(rec[_TABLE_OFF : _TABLE_OFF + 8 * nl])


def _resum(rec: np.ndarray, nl: int) -> None:
    h = xxhash.xxh3_64(memoryview(rec[:_FIXED_BYTES]))
    h.update(memoryview(rec[_TABLE_OFF : _TABLE_OFF + 8 * nl]))
    _U64.pack_into(rec, _HDR_SUM_OFF, h.intdigest())


def seal_room(num_layers: int, seal_bytes: int) -> bool:
    """Whether a record of ``num_layers`` layers has room for a seal in its header padding."""
    return _TABLE_OFF + 8 * num_layers + seal_bytes <= header_bytes(num_layers)


def seal_record(rec: np.ndarray, cipher: Cipher, seal_bytes: int, *, src: np.ndarray | None = None) -> None:
    """Seal the plain record ``rec`` (a writable uint8 array of one whole record) in place; with
    ``src`` (a plain record of the same length), seal ``src`` into ``rec`` instead, reading each
    payload byte once (``src`` is not changed)."""
    if src is not None:
        nl, hb, pb = _geometry(src)
        rec[:hb] = src[:hb]
        rec[hb + pb :] = src[hb + pb : rec.nbytes]
    else:
        nl, hb, pb = _geometry(rec)
    if _FLAGS.unpack_from(rec, 10)[0] & FLAG_SEALED:
        raise ValueError("record is already sealed")
    at = _TABLE_OFF + 8 * nl
    if at + seal_bytes > hb:
        raise ValueError(f"a {nl}-layer record has no room for a {seal_bytes}-byte seal in its header")
    _FLAGS.pack_into(rec, 10, _FLAGS.unpack_from(rec, 10)[0] | FLAG_SEALED)
    tenant = bytes(rec[112:_FIXED_BYTES])
    if src is None:
        seal = cipher.seal(tenant, _aad(rec, nl), memoryview(rec[hb : hb + pb]))
    else:
        seal = cipher.seal(tenant, _aad(rec, nl), memoryview(src[hb : hb + pb]), out=memoryview(rec[hb : hb + pb]))
    rec[at : at + len(seal)] = np.frombuffer(seal, np.uint8)
    _resum(rec, nl)


def open_record(rec: np.ndarray, cipher: Cipher, seal_bytes: int) -> bool:
    """Open the sealed record ``rec`` in place; False (the bytes are then not to be used) when its
    tenant's key is missing or anything was changed. A plain record is left as it is (True)."""
    try:
        nl, hb, pb = _geometry(rec)
    except HeaderCorrupt:
        return True  # not a record: the caller's verify reports it
    flags = _FLAGS.unpack_from(rec, 10)[0]
    if not flags & FLAG_SEALED:
        return True
    at = _TABLE_OFF + 8 * nl
    if at + seal_bytes > hb:
        return False
    seal = bytes(rec[at : at + seal_bytes])
    if not cipher.open(bytes(rec[112:_FIXED_BYTES]), _aad(rec, nl), memoryview(rec[hb : hb + pb]), seal):
        return False
    _FLAGS.pack_into(rec, 10, flags & ~FLAG_SEALED)
    rec[at : at + seal_bytes] = 0
    _resum(rec, nl)
    return True
