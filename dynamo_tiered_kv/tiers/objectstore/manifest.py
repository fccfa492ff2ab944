"""Object names and per-object manifests.

Layout under a backend prefix (docs/OBJECTS.md has the full format)::

    data/<digest>.seg         immutable data object: records back to back (a sealed SSD segment
                              file, or a run packed by ObjectTier.write_many)
    manifests/t<ms>-<mdigest>.json  which records a data object holds: [(key, offset, length), ...]
                              (<ms>: 13-digit created_at in ms, so names list in time order;
                              legacy manifests/<mdigest>.json names are still read)

``digest`` is content-addressed: BLAKE2b-128 over the object size and, per record, its key,
offset, length and an xxh3-128 of its first 4 KiB (the record header, which carries the payload
checksums). Two nodes that flush the same records compute the same name, so conditional create
uploads them once. ``mdigest`` hashes the data name and the entry list, so a manifest rewritten
after a delete gets a new name and the old one can be removed.

A manifest is published only after its data object, so a visible manifest always points at
complete data. Its body carries an xxh3-64 checksum; a damaged manifest is ignored, never used.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import xxhash

from ...blocks.keys import KEY_BYTES
from ...blocks.tenant import DEFAULT_TENANT
from ...errors import TieredKVError
from ..segments import SegmentEntry
from .layout import manifest_name

MANIFEST_VERSION = 1
DATA_DIR = "data/"
MANIFEST_DIR = "manifests/"
TOMBSTONE_DIR = "tombstones/"  # gc: "this data object lost its last manifest at <mtime>"
MAX_RETAIN_S = 30 * 86400.0  # hint-given retention may keep a manifest this long past its creation
_SAMPLE = 4096
_ENTRY = struct.Struct("<16sQQ")


class ManifestError(TieredKVError):
    """A manifest object is unreadable (corrupt, truncated, unknown version)."""


def content_digest(size: int, entries: Sequence[SegmentEntry], sample: Callable[[int, int], bytes]) -> str:
    """Content address of a data object of ``size`` bytes holding ``entries``.

    ``sample(offset, n)`` returns ``n`` bytes of the object at ``offset`` (record headers).
    """
    h = hashlib.blake2b(digest_size=16, person=b"dtkv-obj-v1")
    h.update(struct.pack("<QQ", size, len(entries)))
    for e in entries:
        h.update(_ENTRY.pack(e.key, e.offset, e.length))
        h.update(xxhash.xxh3_128_digest(sample(e.offset, min(_SAMPLE, e.length))))
    return h.hexdigest()


def alternate_digest(digest: str, n: int) -> str:
    """The ``n``-th alternate name digest of content ``digest`` (n >= 1): where the content is
    uploaded again when the copy under its own name was reported corrupt (``writes.py``).
    Derived, not random, so every node re-uploading the same content picks the same name."""
    h = hashlib.blake2b(digest_size=16, person=b"dtkv-alt-v1")
    h.update(f"{digest}/{n}".encode())
    return h.hexdigest()


def data_name(digest: str) -> str:
    return f"{DATA_DIR}{digest}.seg"


def tombstone_name(data: str) -> str:
    return f"{TOMBSTONE_DIR}{digest_of(data)}"


def digest_of(name: str) -> str:
    """The hex digest in a data or manifest object name."""
    return name.rsplit("/", 1)[-1].split(".", 1)[0]


@dataclass(frozen=True)
class Manifest:
    """The record index of one data object.

    Attributes:
        data: data object name (relative to the backend prefix).
        data_size: data object size in bytes.
        created_at: unix time the data was first published (retention counts from here).
        entries: records in the object, in offset order.
        origin: free-form producer tag (node and segment id) for operators.
        retain: retention classes of some entries, ``(entry index, priority, expiry)`` (expiry in
            unix seconds, None: none); optional, written only when non-empty (docs/FORMAT.md).
    """

    data: str
    data_size: int
    created_at: float
    entries: tuple[SegmentEntry, ...]
    origin: str = ""
    retain: tuple[tuple[int, int, float | None], ...] = ()

    def __post_init__(self) -> None:
        for e in self.entries:
            if len(e.key) != KEY_BYTES or e.offset < 0 or e.length <= 0 or e.offset + e.length > self.data_size:
                raise ManifestError(f"entry {e} does not fit a {self.data_size}-byte object")
        for i, p, _ in self.retain:
            if not (0 <= i < len(self.entries) and 0 < p <= 100):
                raise ManifestError(f"retain entry ({i}, {p}) does not name a retained entry")

    def keep_until(self, ttl_s: float | None) -> float | None:
        """When this manifest expires: ``created_at + ttl_s``, extended by retained entries up to
        ``created_at + MAX_RETAIN_S`` (None: never)."""
        return keep_until(self.created_at, ttl_s, (e for _, _, e in self.retain))

    @property
    def name(self) -> str:
        h = hashlib.blake2b(digest_size=16, person=b"dtkv-man-v1")
        h.update(self.data.encode())
        for e in self.entries:
            h.update(_ENTRY.pack(e.key, e.offset, e.length))
        if self.retain:  # a new retention is a new manifest (newest wins); none keeps old names
            h.update(json.dumps(self.retain).encode())
        return manifest_name(self.created_at, h.hexdigest())  # time-ordered: listings resume with StartAfter

    @property
    def live_bytes(self) -> int:
        return sum(e.length for e in self.entries)

    def with_entries(self, entries: Sequence[SegmentEntry]) -> Manifest:
        keys = {e.key for e in entries}
        idx = {e.key: i for i, e in enumerate(entries)}
        retain = tuple((idx[self.entries[i].key], p, x) for i, p, x in self.retain if self.entries[i].key in keys)
        return Manifest(self.data, self.data_size, self.created_at, tuple(entries), self.origin, retain)

    def to_bytes(self) -> bytes:
        body = {
            "version": MANIFEST_VERSION,
            "data": self.data,
            "data_size": self.data_size,
            "created_at": self.created_at,
            "origin": self.origin,
            "entries": [[e.key.hex(), e.offset, e.length] for e in self.entries],
        }
        if self.retain:
            body["retain"] = [list(r) for r in self.retain]
        if any(e.tenant != DEFAULT_TENANT for e in self.entries):  # absent: every record is the default tenant's
            body["tenants"] = [e.tenant.hex() for e in self.entries]
        raw = json.dumps(body, separators=(",", ":"), sort_keys=True)
        return json.dumps({"body": body, "xxh3": xxhash.xxh3_64_hexdigest(raw.encode())},
                          separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        try:
            body = checked_body(raw)
            tenants = parse_tenants(body.get("tenants"), len(body["entries"]))
            entries = tuple(SegmentEntry(bytes.fromhex(k), int(o), int(n), t)
                            for (k, o, n), t in zip(body["entries"], tenants, strict=True))
            retain = tuple(parse_retain(body.get("retain")))
            return cls(str(body["data"]), int(body["data_size"]), float(body["created_at"]), entries,
                       str(body.get("origin", "")), retain)
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"unreadable manifest: {type(e).__name__}: {e}") from None


def parse_tenants(raw: object, n: int) -> list[bytes]:
    """The optional ``tenants`` field: one tenant id (16 hex digits) per entry."""
    if raw is None:
        return [DEFAULT_TENANT] * n
    if not isinstance(raw, list) or len(raw) != n:
        raise ValueError("tenants must list one tenant per entry")
    out = [bytes.fromhex(t) for t in raw]
    if any(len(t) != len(DEFAULT_TENANT) for t in out):
        raise ValueError("a tenant id is 8 bytes")
    return out


def parse_retain(raw: object) -> list[tuple[int, int, float | None]]:
    """The optional ``retain`` field: ``[[entry index, priority, expiry | null], ...]``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError("retain must be a list")
    out = []
    for i, p, x in raw:
        out.append((int(i), int(p), None if x is None else float(x)))
    return out


def keep_until(created_at: float, ttl_s: float | None, expiries: Iterable[float | None]) -> float | None:
    """End of a manifest's life: its TTL, extended by its retained entries' expiries (a retained
    entry without expiry counts as ``MAX_RETAIN_S``), never past ``created_at + MAX_RETAIN_S``."""
    if ttl_s is None:
        return None
    end = created_at + ttl_s
    for x in expiries:
        end = max(end, min(created_at + MAX_RETAIN_S, created_at + MAX_RETAIN_S if x is None else x))
    return end


def checked_body(raw: bytes) -> dict:
    """A manifest's body once its checksum and version hold.

    Raises:
        ManifestError: checksum mismatch or another version; JSON and lookup errors propagate
            for the caller to report as an unreadable manifest.
    """
    doc = json.loads(raw)
    body = doc["body"]
    canon = json.dumps(body, separators=(",", ":"), sort_keys=True)
    if xxhash.xxh3_64_hexdigest(canon.encode()) != doc["xxh3"]:
        raise ManifestError("manifest checksum mismatch")
    if body["version"] != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {body['version']} is not {MANIFEST_VERSION}")
    return body
