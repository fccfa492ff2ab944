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
#: the fixed header's fields sealing needs: magic, flags, header bytes, layers, payload bytes
_GEOM = struct.Struct("<8s2xHI52xI24xQ")
_TENANT = slice(112, _FIXED_BYTES)
#: bytes after a payload that let the cipher open it with one call (the GCM tag's length)
TAG_ROOM = 16
assert _GEOM.size == 104


class Cipher(Protocol):
    def seal(self, tenant: bytes, aad: bytes, payload: memoryview, out: memoryview | None = None) -> bytes: ...

    def open(self, tenant: bytes, aad: bytes, payload: memoryview, seal: bytes, *, lent: int = 0) -> bool: ...


def _geometry_of(fixed: bytes, nbytes: int) -> tuple[int, int, int, int]:
    """(flags, num_layers, header_bytes, payload_bytes) of a record whose fixed header is ``fixed``
    and whose buffer holds ``nbytes``, checked only for bounds."""
    if nbytes < _TABLE_OFF or len(fixed) < _FIXED_BYTES:
        raise HeaderCorrupt("not a record")
    magic, flags, hb, nl, pb = _GEOM.unpack_from(fixed)
    if magic != MAGIC:
        raise HeaderCorrupt("not a record")
    if nl <= 0 or nl > 65536 or hb != header_bytes(nl) or nbytes < hb + pb:
        raise HeaderCorrupt("implausible record header")
    return flags, nl, hb, pb


def _geometry(rec: np.ndarray) -> tuple[int, int, int]:
    """(num_layers, header_bytes, payload_bytes) of a record's header, checked only for bounds."""
    _, nl, hb, pb = _geometry_of(rec[:_FIXED_BYTES].tobytes(), rec.nbytes)
    return nl, hb, pb


def is_sealed(rec: np.ndarray) -> bool:
    return rec.nbytes >= _FIXED_BYTES and bytes(rec[:8]) == MAGIC and bool(
        _FLAGS.unpack_from(rec, 10)[0] & FLAG_SEALED)


def _with_flags(fixed: bytes, flags: int) -> bytes:
    return fixed[:10] + _FLAGS.pack(flags) + fixed[12:]


def seal_room(num_layers: int, seal_bytes: int) -> bool:
    """Whether a record of ``num_layers`` layers has room for a seal in its header padding."""
    return _TABLE_OFF + 8 * num_layers + seal_bytes <= header_bytes(num_layers)


def seal_record(rec: np.ndarray, cipher: Cipher, seal_bytes: int, *, src: np.ndarray | None = None,
                spare: int = 0) -> None:
    """Seal the plain record ``rec`` (a writable uint8 array of one whole record) in place; with
    ``src`` (a plain record), seal ``src`` into ``rec`` instead, reading each payload byte once
    (``src`` is not changed). ``spare`` (with ``src`` only): ``rec`` is the record followed by
    ``spare`` bytes this may overwrite (scratch for the GCM tag, so the cipher's one-call path
    runs); the record itself is ``rec[:rec.nbytes - spare]``, as long as ``src``."""
    if src is not None:
        n = rec.nbytes - spare
        if spare < 0 or src.nbytes != n:
            raise ValueError(f"a {src.nbytes}-byte record does not fit {rec.nbytes} bytes with {spare} spare")
        fixed = src[:_FIXED_BYTES].tobytes()
        flags, nl, hb, pb = _geometry_of(fixed, n)
    else:
        if spare:
            raise ValueError("spare bytes are for sealing from a source")
        n = rec.nbytes
        fixed = rec[:_FIXED_BYTES].tobytes()
        flags, nl, hb, pb = _geometry_of(fixed, n)
    if flags & FLAG_SEALED:
        raise ValueError("record is already sealed")
    at = _TABLE_OFF + 8 * nl
    if at + seal_bytes > hb:
        raise ValueError(f"a {nl}-layer record has no room for a {seal_bytes}-byte seal in its header")
    fixed = _with_flags(fixed, flags | FLAG_SEALED)
    if src is not None:
        rec[:hb] = src[:hb]
        table = src[_TABLE_OFF:at].tobytes()
    else:
        table = rec[_TABLE_OFF:at].tobytes()
    aad = fixed + table
    out = memoryview(rec)
    if src is None:
        seal = cipher.seal(fixed[_TENANT], aad, out[hb : hb + pb])
    else:
        seal = cipher.seal(fixed[_TENANT], aad, memoryview(src)[hb : hb + pb], out=out[hb:])
        if n > hb + pb:  # the padding after the payload: after the cipher, which may use it as scratch
            rec[hb + pb : n] = src[hb + pb : n]
    _FLAGS.pack_into(out, 10, flags | FLAG_SEALED)
    rec[at : at + len(seal)] = np.frombuffer(seal, np.uint8)
    _U64.pack_into(out, _HDR_SUM_OFF, xxhash.xxh3_64_intdigest(aad))


def open_record(rec: np.ndarray, cipher: Cipher, seal_bytes: int, *, lent: int = 0) -> bool:
    """Open the sealed record ``rec`` in place; False (the bytes are then not to be used) when its
    tenant's key is missing or anything was changed. A plain record is left as it is (True).
    ``lent``: ``rec`` is the record followed by ``lent`` bytes the cipher may borrow as room for the
    tag (no other thread may use them meanwhile; they hold what they held before on return)."""
    try:
        fixed = rec[:_FIXED_BYTES].tobytes()
        flags, nl, hb, pb = _geometry_of(fixed, rec.nbytes - lent)
    except HeaderCorrupt:
        return True  # not a record: the caller's verify reports it
    if not flags & FLAG_SEALED:
        return True
    at = _TABLE_OFF + 8 * nl
    if at + seal_bytes > hb:
        return False
    table_seal = rec[_TABLE_OFF : at + seal_bytes].tobytes()
    table = table_seal[: 8 * nl]
    mv = memoryview(rec)
    room = min(TAG_ROOM, rec.nbytes - hb - pb)  # the record's own padding, then the lent bytes
    if room < TAG_ROOM:
        opened = cipher.open(fixed[_TENANT], fixed + table, mv[hb : hb + pb], table_seal[8 * nl :])
    else:
        opened = cipher.open(fixed[_TENANT], fixed + table, mv[hb : hb + pb + room], table_seal[8 * nl :], lent=room)
    if not opened:
        return False
    plain = _with_flags(fixed, flags & ~FLAG_SEALED)
    _FLAGS.pack_into(mv, 10, flags & ~FLAG_SEALED)
    rec[at : at + seal_bytes] = 0
    _U64.pack_into(mv, _HDR_SUM_OFF, xxhash.xxh3_64_intdigest(plain + table))
    return True
