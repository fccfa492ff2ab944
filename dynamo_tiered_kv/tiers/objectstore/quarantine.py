"""Quarantine: how a node reports a record it could not verify without touching shared data.

The bucket is the system of record for every node, so one node's failed read must never delete
or rewrite shared objects: the bad bytes may have been flipped in transit, and the data is good
for everyone else. A node that fails a record twice (the first read and one re-read) stops
serving it locally and writes a small marker ``quarantine/<data digest>.<offset>.json``; the
name is per record location, so many nodes reporting the same record write one marker.

``dtkv fsck`` lists the markers; ``dtkv gc`` resolves them (``resolve_quarantine``): it reads the
record again itself and

* clears the marker if the record verifies (a transient fault), or if no manifest lists the
  location any more, or its data object is gone (the normal GC rules then apply);
* otherwise (two more failed reads) publishes every manifest that lists it again without that
  entry, deletes the old manifest, and clears the marker.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from ...blocks.codec import verify_record
from ...errors import RecordError, TierUnavailable
from .backend import ObjectBackend
from .manifest import MANIFEST_DIR, Manifest, ManifestError, digest_of

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine/"


class MarkerError(ValueError):
    """A quarantine marker object is unreadable."""


@dataclass(frozen=True)
class QuarantineMarker:
    """One record location a node failed to verify twice."""

    data: str  # data object name
    offset: int
    length: int
    key: bytes
    reason: str
    origin: str = ""
    at: float = 0.0  # unix time the marker was written

    @property
    def name(self) -> str:
        return marker_name(self.data, self.offset)

    def to_bytes(self) -> bytes:
        return json.dumps({"data": self.data, "offset": self.offset, "length": self.length,
                           "key": self.key.hex(), "reason": self.reason, "origin": self.origin,
                           "at": self.at}, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> QuarantineMarker:
        try:
            d = json.loads(raw)
            return cls(str(d["data"]), int(d["offset"]), int(d["length"]), bytes.fromhex(d["key"]),
                       str(d.get("reason", "")), str(d.get("origin", "")), float(d.get("at", 0.0)))
        except (ValueError, KeyError, TypeError) as e:
            raise MarkerError(f"unreadable quarantine marker: {type(e).__name__}: {e}") from None


def marker_name(data: str, offset: int) -> str:
    return f"{QUARANTINE_DIR}{digest_of(data)}.{offset}.json"


async def write_marker(backend: ObjectBackend, marker: QuarantineMarker) -> bool:
    """Publish ``marker`` (create-if-absent: the first reporter's marker is kept)."""
    return await backend.put_object(marker.name, marker.to_bytes(), if_absent=True)


async def has_markers(backend: ObjectBackend, data: str) -> bool:
    """Whether some node reported a record of data object ``data`` (one LIST of its markers).
    Writers use it before reusing a stored copy (``writes.py``)."""
    return bool(await backend.list(f"{QUARANTINE_DIR}{digest_of(data)}."))


async def read_markers(backend: ObjectBackend) -> list[tuple[str, QuarantineMarker | None]]:
    """Every marker as (object name, marker or None if unreadable)."""
    out: list[tuple[str, QuarantineMarker | None]] = []
    for info in await backend.list(QUARANTINE_DIR):
        raw = await backend.get_bytes(info.name)
        if raw is None:
            continue
        try:
            out.append((info.name, QuarantineMarker.from_bytes(raw)))
        except MarkerError:
            out.append((info.name, None))
    return out


async def record_fails(backend: ObjectBackend, data: str, offset: int, length: int, key: bytes,
                       reads: int = 2) -> str | None:
    """Why the record at ``data[offset:+length]`` fails key-only verification on each of ``reads``
    fresh reads, or None if one read verifies or the data is gone (nothing to quarantine)."""
    why = None
    for _ in range(reads):
        buf = bytearray(length)
        if await backend.get_range(data, offset, [memoryview(buf)]) is None:
            return None
        try:
            verify_record(memoryview(buf), key=key)
            return None
        except RecordError as e:
            why = f"{type(e).__name__}: {e}"
    return why


@dataclass
class QuarantineReport:
    markers: int = 0
    cleared: int = 0  # the record verified again, or nothing lists it any more
    dropped: int = 0  # confirmed bad: its entry was removed from the manifests listing it
    errors: int = 0


async def resolve_quarantine(backend: ObjectBackend, *, dry_run: bool = False) -> QuarantineReport:
    """Examine every marker and resolve it (module docstring). Raises ``TierUnavailable`` if the
    store cannot be listed; a failed step leaves the marker for the next run."""
    rep = QuarantineReport()
    markers = await read_markers(backend)
    rep.markers = len(markers)
    if not markers:
        return rep
    manifests: dict[str, Manifest] = {}
    for info in await backend.list(MANIFEST_DIR):
        raw = await backend.get_bytes(info.name)
        if raw is not None:
            try:
                manifests[info.name] = Manifest.from_bytes(raw)
            except ManifestError:
                continue  # gc's own rules handle unreadable manifests
    for name, mk in markers:
        try:
            if mk is None:
                why = None
                holders: list[str] = []
            else:
                holders = [n for n, m in manifests.items() if m.data == mk.data
                           and any(e.key == mk.key and e.offset == mk.offset for e in m.entries)]
                why = await record_fails(backend, mk.data, mk.offset, mk.length, mk.key) if holders else None
            if why is None:
                rep.cleared += 1
            else:
                assert mk is not None
                log.warning("gc: record %s at %s@%d is corrupt (%s); dropping it from %d manifests",
                            mk.key.hex(), mk.data, mk.offset, why, len(holders))
                rep.dropped += 1
                if not dry_run:
                    for n in holders:
                        await _drop_entry(backend, n, manifests.pop(n), mk.key, mk.offset)
            if not dry_run:
                await backend.delete(name)
        except TierUnavailable as e:
            rep.errors += 1
            log.warning("gc: quarantine %s: %s", name, e)
    return rep


async def _drop_entry(backend: ObjectBackend, name: str, m: Manifest, key: bytes, offset: int) -> None:
    keep = [e for e in m.entries if not (e.key == key and e.offset == offset)]
    if keep:  # the replacement first: the other records never become undiscoverable
        new = m.with_entries(keep)
        await backend.put_object(new.name, new.to_bytes(), if_absent=True)
    await backend.delete(name)


def new_marker(data: str, offset: int, length: int, key: bytes, reason: str, origin: str) -> QuarantineMarker:
    return QuarantineMarker(data, offset, length, key, reason, origin, time.time())


__all__ = ["QUARANTINE_DIR", "QuarantineMarker", "QuarantineReport", "has_markers", "marker_name", "new_marker",
           "read_markers", "record_fails", "resolve_quarantine", "write_marker"]
