"""Index snapshots: one checksummed object holding a namespace's compacted index.

Format (docs/OBJECTS.md, "Index snapshot"), all integers little-endian::

    header   64 B   magic "DTKVIX01", u32 version (3; 1 and 2 are read too), u32 header bytes (64),
                    u64 n_objects, u64 n_blocks, i64 watermark_ms, f64 written_at, u32 odd_bytes,
                    u32 n_retained (version 1: zero), u32 n_tenants, u32 n_mixed (versions 1-2: zero)
    objects  n_objects x 49 B: manifest digest (16), data digest (16), i64 name ms (-1 legacy
                    name), f64 created_at, u8 flags (1 = legacy root layout)
    odd      odd_bytes of UTF-8 JSON {"<object id>": [manifest name, data name]} (non-canonical names)
    keys     n_blocks x 16 B, sorted ascending (bytewise), no duplicates
    obj      n_blocks x u32 object id
    offset   n_blocks x u64
    length   n_blocks x u32
    retained n_retained x 25 B: key (16), u8 priority (1-100), f64 expiry (unix s; NaN: none),
             keys strictly ascending: the retention classes (``kv.retain``) of indexed blocks,
             so a process that starts from the snapshot keeps them (the manifests it skips
             carried them)
    version 3 only:
    tenants  n_tenants x 8 B: tenant id of each code (code 0 first)
    objten   n_objects x u32: tenant code of each object's records (0xFFFFFFFF: several, in mixed)
    mixed    n_mixed x 12 B: u32 object id, u32 offset, u32 tenant code: the records of objects
             whose code is 0xFFFFFFFF, ascending by (object, offset)
    xxh3     16 B: XXH3-128 (big-endian digest bytes) of everything before it

A snapshot without tenants (``Snapshot.tenants`` None) is written as version 2; versions 1 and 2
decode with ``tenants`` None, and the tier does not start from them (``Catalog.load_snapshot``).

A snapshot that is short, has another magic/version, unsorted keys, out-of-range object ids or
a wrong checksum raises ``SnapshotError``: the loader ignores it and lists every manifest.
"""

from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ...errors import TieredKVError
from .backend import ObjectBackend
from .index import U32_MAX, join_keys, split_keys

MAGIC = b"DTKVIX01"
VERSION = 3
_HEADER = struct.Struct("<8sIIQQqdIIII")
OBJ_DTYPE = np.dtype([("mdig", "u1", (16,)), ("ddig", "u1", (16,)), ("ms", "<i8"), ("created", "<f8"), ("flags", "u1")])
RET_DTYPE = np.dtype([("key", "u1", (16,)), ("prio", "u1"), ("expiry", "<f8")])
MIX_DTYPE = np.dtype([("obj", "<u4"), ("off", "<u4"), ("code", "<u4")])
MIXED_CODE = 0xFFFFFFFF
assert _HEADER.size == 64 and OBJ_DTYPE.itemsize == 49 and RET_DTYPE.itemsize == 25 and MIX_DTYPE.itemsize == 12


class SnapshotError(TieredKVError):
    """An index snapshot is unreadable or fails its checksum (never trusted)."""


@dataclass
class Snapshot:
    objects: np.ndarray  # OBJ_DTYPE
    odd: dict[int, tuple[str, str]]
    k0: np.ndarray
    k1: np.ndarray
    obj: np.ndarray  # u32
    off: np.ndarray  # u32 in memory (entries past 4 GiB are refused when indexing)
    len: np.ndarray  # u32
    watermark_ms: int
    written_at: float = 0.0
    #: key -> (priority 1-100, expiry unix s or None) of retained indexed blocks
    retained: dict[bytes, tuple[int, float | None]] = field(default_factory=dict)
    #: tenant id of each code; None: the snapshot does not name tenants (versions 1 and 2)
    tenants: list[bytes] | None = None
    object_tenants: np.ndarray | None = None  # u32 code per object (MIXED_CODE: see ``mixed``)
    mixed: np.ndarray | None = None  # MIX_DTYPE rows, ascending by (obj, off)


def mixed_rows(objects: list[tuple[int, np.ndarray, np.ndarray]]) -> np.ndarray:
    """MIX_DTYPE rows of ``(object id, record offsets, record codes)`` (ids ascending)."""
    out = np.zeros(sum(len(o) for _, o, _ in objects), MIX_DTYPE)
    pos = 0
    for i, offs, codes in objects:
        out["obj"][pos:pos + len(offs)] = i
        out["off"][pos:pos + len(offs)] = offs
        out["code"][pos:pos + len(offs)] = codes
        pos += len(offs)
    return out


async def fetch(backend: ObjectBackend, name: str) -> np.ndarray | None:
    """The whole snapshot object, read into one uninitialized buffer (``get_bytes`` would zero
    one and copy it into ``bytes``: ~1 s of page faults and copies at 10M blocks); None when
    there is none."""
    info = await backend.head(name)
    if info is None:
        return None
    buf = np.empty(info.size, np.uint8)
    if info.size and await backend.get_range(name, 0, [memoryview(buf)]) is None:
        return None
    return buf


def encode(s: Snapshot) -> bytes:
    odd = json.dumps({str(k): list(v) for k, v in s.odd.items()}, separators=(",", ":")).encode()
    keys = sorted(s.retained)
    ret = np.zeros(len(keys), RET_DTYPE)
    if keys:
        ret["key"] = np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 16)
        ret["prio"] = [s.retained[k][0] for k in keys]
        ret["expiry"] = [math.nan if (x := s.retained[k][1]) is None else x for k in keys]
    tenanted = s.tenants is not None
    mixed = s.mixed if s.mixed is not None else np.zeros(0, MIX_DTYPE)
    parts = [
        _HEADER.pack(MAGIC, VERSION if tenanted else 2, _HEADER.size, len(s.objects), len(s.k0), s.watermark_ms,
                     s.written_at or time.time(), len(odd), len(ret), len(s.tenants or ()), len(mixed)),
        s.objects.astype(OBJ_DTYPE).tobytes(), odd, join_keys(s.k0, s.k1),
        s.obj.astype("<u4").tobytes(), s.off.astype("<u8").tobytes(), s.len.astype("<u4").tobytes(),
        ret.tobytes(),
    ]
    if tenanted:
        assert s.object_tenants is not None and all(len(t) == 8 for t in s.tenants or ())
        parts += [b"".join(s.tenants or ()), np.asarray(s.object_tenants).astype("<u4").tobytes(),
                  mixed.astype(MIX_DTYPE).tobytes()]
    body = b"".join(parts)
    return body + xxhash.xxh3_128_digest(body)


def decode(raw: bytes | bytearray | memoryview | np.ndarray) -> Snapshot:
    mv = memoryview(raw)
    if len(mv) < _HEADER.size + 16:
        raise SnapshotError(f"snapshot of {len(mv)} bytes is too short")
    magic, version, hlen, n_obj, n_blk, wm, written, odd_len, n_ret, n_ten, n_mix = _HEADER.unpack_from(mv, 0)
    if (magic != MAGIC or version not in (1, 2, VERSION) or hlen != _HEADER.size or (version == 1 and n_ret)
            or (version < 3 and (n_ten or n_mix)) or (version == 3 and not n_ten)):
        raise SnapshotError(f"not a version-1 to version-{VERSION} index snapshot")
    size = hlen + n_obj * OBJ_DTYPE.itemsize + odd_len + n_blk * 32 + n_ret * RET_DTYPE.itemsize + 16
    if version == 3:
        size += n_ten * 8 + n_obj * 4 + n_mix * MIX_DTYPE.itemsize
    if len(mv) != size:
        raise SnapshotError(f"snapshot holds {len(mv)} bytes, its header says {size}")
    if xxhash.xxh3_128_digest(mv[:-16]) != bytes(mv[-16:]):
        raise SnapshotError("snapshot checksum mismatch")
    pos = hlen
    objects = np.frombuffer(mv, OBJ_DTYPE, n_obj, pos)
    pos += objects.nbytes
    try:
        odd = {int(k): (str(v[0]), str(v[1])) for k, v in json.loads(bytes(mv[pos:pos + odd_len])).items()}
    except (ValueError, TypeError, IndexError, AttributeError) as e:
        raise SnapshotError(f"snapshot names section: {e}") from None
    pos += odd_len
    k0, k1 = split_keys(mv[pos:pos + n_blk * 16])
    pos += n_blk * 16
    obj = np.frombuffer(mv, "<u4", n_blk, pos).astype(np.uint32)
    pos += n_blk * 4
    off = np.frombuffer(mv, "<u8", n_blk, pos)
    pos += n_blk * 8
    ln = np.frombuffer(mv, "<u4", n_blk, pos).astype(np.uint32)
    pos += n_blk * 4
    retained = _retained(np.frombuffer(mv, RET_DTYPE, n_ret, pos))
    pos += n_ret * RET_DTYPE.itemsize
    if not _sorted_unique(k0, k1):
        raise SnapshotError("snapshot keys are not sorted and unique")
    if n_blk and (int(obj.max()) >= n_obj or int(off.max()) > U32_MAX):
        raise SnapshotError("snapshot entry out of range")
    out = Snapshot(np.array(objects), odd, k0, k1, obj, off.astype(np.uint32), ln, int(wm), float(written),
                   retained)
    if version == 3:
        raw_ids = bytes(mv[pos:pos + n_ten * 8])
        out.tenants = [raw_ids[i:i + 8] for i in range(0, len(raw_ids), 8)]
        pos += n_ten * 8
        out.object_tenants = np.frombuffer(mv, "<u4", n_obj, pos).astype(np.uint32)
        pos += n_obj * 4
        out.mixed = np.frombuffer(mv, MIX_DTYPE, n_mix, pos).copy()
        _check_tenants(out, n_ten)
    return out


def _check_tenants(s: Snapshot, n_ten: int) -> None:
    """Codes in range, and the mixed rows exactly the records of the objects marked mixed."""
    assert s.object_tenants is not None and s.mixed is not None
    codes, mixed = s.object_tenants, s.mixed
    if bool(np.any((codes >= n_ten) & (codes != MIXED_CODE))) or bool(np.any(mixed["code"] >= n_ten)):
        raise SnapshotError("snapshot tenant code out of range")
    key = (mixed["obj"].astype(np.uint64) << np.uint64(32)) | mixed["off"].astype(np.uint64)
    if bool(np.any(key[1:] <= key[:-1])) or bool(np.any(mixed["obj"] >= len(codes))):
        raise SnapshotError("snapshot mixed-tenant rows are not sorted, unique and in range")
    is_mixed = np.flatnonzero(codes == MIXED_CODE)
    if not np.array_equal(np.unique(mixed["obj"]), is_mixed):
        raise SnapshotError("snapshot mixed-tenant rows do not match the objects marked mixed")
    rows = np.flatnonzero(np.isin(s.obj, is_mixed))
    if len(rows):
        want = (s.obj[rows].astype(np.uint64) << np.uint64(32)) | s.off[rows].astype(np.uint64)
        at = np.minimum(np.searchsorted(key, want), len(key) - 1)
        if bool(np.any(key[at] != want)):
            raise SnapshotError("a record of a mixed-tenant object has no tenant in the snapshot")


def _sorted_unique(k0: np.ndarray, k1: np.ndarray) -> bool:
    """Keys (as ``split_keys`` columns) strictly ascending: k0 non-decreasing, and k1 increasing
    where k0 ties (rare: few rows)."""
    tie = np.flatnonzero(k0[1:] == k0[:-1])
    return bool(np.all(k0[1:] >= k0[:-1])) and bool(np.all(k1[tie + 1] > k1[tie]))


def _retained(rows: np.ndarray) -> dict[bytes, tuple[int, float | None]]:
    if not len(rows):
        return {}
    raw = rows["key"].tobytes()
    if not _sorted_unique(*split_keys(raw)):
        raise SnapshotError("snapshot retained keys are not sorted and unique")
    keys = [raw[i:i + 16] for i in range(0, len(raw), 16)]
    prio, expiry = rows["prio"], rows["expiry"]
    if bool(np.any((prio < 1) | (prio > 100))) or bool(np.any(np.isinf(expiry))):
        raise SnapshotError("snapshot retention out of range")
    return {k: (int(p), None if math.isnan(x) else float(x)) for k, p, x in zip(keys, prio.tolist(), expiry.tolist())}
