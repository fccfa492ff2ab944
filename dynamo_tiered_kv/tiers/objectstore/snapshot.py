"""Index snapshots: one checksummed object holding a namespace's compacted index.

Format (docs/OBJECTS.md, "Index snapshot"), all integers little-endian::

    header   64 B   magic "DTKVIX01", u32 version (2; 1 is read too), u32 header bytes (64),
                    u64 n_objects, u64 n_blocks, i64 watermark_ms, f64 written_at, u32 odd_bytes,
                    u32 n_retained (version 1: zero), 8 B zero
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
    xxh3     16 B: XXH3-128 (big-endian digest bytes) of everything before it

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
VERSION = 2
_HEADER = struct.Struct("<8sIIQQqdII8x")
OBJ_DTYPE = np.dtype([("mdig", "u1", (16,)), ("ddig", "u1", (16,)), ("ms", "<i8"), ("created", "<f8"), ("flags", "u1")])
RET_DTYPE = np.dtype([("key", "u1", (16,)), ("prio", "u1"), ("expiry", "<f8")])
assert _HEADER.size == 64 and OBJ_DTYPE.itemsize == 49 and RET_DTYPE.itemsize == 25


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
    parts = [
        _HEADER.pack(MAGIC, VERSION, _HEADER.size, len(s.objects), len(s.k0), s.watermark_ms,
                     s.written_at or time.time(), len(odd), len(ret)),
        s.objects.astype(OBJ_DTYPE).tobytes(), odd, join_keys(s.k0, s.k1),
        s.obj.astype("<u4").tobytes(), s.off.astype("<u8").tobytes(), s.len.astype("<u4").tobytes(),
        ret.tobytes(),
    ]
    body = b"".join(parts)
    return body + xxhash.xxh3_128_digest(body)


def decode(raw: bytes | bytearray | memoryview | np.ndarray) -> Snapshot:
    mv = memoryview(raw)
    if len(mv) < _HEADER.size + 16:
        raise SnapshotError(f"snapshot of {len(mv)} bytes is too short")
    magic, version, hlen, n_obj, n_blk, wm, written, odd_len, n_ret = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC or version not in (1, VERSION) or hlen != _HEADER.size or (version == 1 and n_ret):
        raise SnapshotError(f"not a version-1 or version-{VERSION} index snapshot")
    size = hlen + n_obj * OBJ_DTYPE.itemsize + odd_len + n_blk * 32 + n_ret * RET_DTYPE.itemsize + 16
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
    if not _sorted_unique(k0, k1):
        raise SnapshotError("snapshot keys are not sorted and unique")
    if n_blk and (int(obj.max()) >= n_obj or int(off.max()) > U32_MAX):
        raise SnapshotError("snapshot entry out of range")
    return Snapshot(np.array(objects), odd, k0, k1, obj, off.astype(np.uint32), ln, int(wm), float(written),
                    retained)


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
