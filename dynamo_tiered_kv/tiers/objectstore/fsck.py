"""Verify every record in an object store: ``await fsck_url("s3://bucket/prefix")``.

For each manifest: the manifest parses and its checksum holds, its data object exists with the
recorded size, and every record verifies (``codec.verify_record``: header and payload
checksums, and the key the manifest names). Data is read one contiguous run per GET, in chunks
of at most ``chunk_bytes``. Data objects no manifest references are reported as orphans
(a warning: ``dtkv gc`` collects them). Quarantine markers (records a node failed to verify
twice; ``quarantine.py``) are listed as warnings too: a record that is really bad also shows up
as a problem above, and ``dtkv gc`` resolves every marker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...blocks.codec import verify_record
from ...errors import RecordError
from ..segments import SegmentEntry
from .backend import ObjectBackend
from .layout import NamespaceView, list_namespaces, ns_prefix
from .manifest import DATA_DIR, MANIFEST_DIR, Manifest, ManifestError
from .quarantine import read_markers
from .tenants import ERASURE_DIR, erased_records_left
from .urls import backend_from_url

DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass
class FsckProblem:
    object: str
    error: str
    key: str = ""
    offset: int | None = None


@dataclass
class FsckReport:
    manifests: int = 0
    data_objects: int = 0
    records_ok: int = 0
    bytes_verified: int = 0
    orphans: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  # "<data>@<offset> key <hex>: <reason>"
    problems: list[FsckProblem] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def fsck_backend(backend: ObjectBackend, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> FsckReport:
    """Check everything under an opened backend. Raises ``TierUnavailable`` if it cannot list."""
    rep = FsckReport()
    names = [m.name for m in await backend.list(MANIFEST_DIR)]
    data = {d.name: d for d in await backend.list(DATA_DIR)}
    rep.manifests, rep.data_objects = len(names), len(data)
    referenced: set[str] = set()
    for name in names:
        raw = await backend.get_bytes(name)
        if raw is None:
            continue  # deleted while we ran
        try:
            m = Manifest.from_bytes(raw)
        except ManifestError as e:
            rep.problems.append(FsckProblem(name, str(e)))
            continue
        referenced.add(m.data)
        info = data.get(m.data) or await backend.head(m.data)
        if info is None:
            rep.problems.append(FsckProblem(name, f"data object {m.data} is missing"))
            continue
        if info.size != m.data_size:
            rep.problems.append(FsckProblem(m.data, f"size {info.size} != manifest's {m.data_size}"))
            continue
        for run in _runs(m.entries, chunk_bytes):
            await _check_run(backend, m.data, run, rep)
    rep.orphans = sorted(n for n in data if n not in referenced)
    for name, mk in await read_markers(backend):
        rep.quarantined.append(f"{name}: unreadable marker" if mk is None else
                               f"{mk.data}@{mk.offset} key {mk.key.hex()}: {mk.reason} (from {mk.origin})")
    return rep


def _runs(entries: tuple[SegmentEntry, ...], chunk_bytes: int) -> list[list[SegmentEntry]]:
    runs: list[list[SegmentEntry]] = []
    for e in sorted(entries, key=lambda e: e.offset):
        cur = runs[-1] if runs else None
        if (cur and cur[-1].offset + cur[-1].length == e.offset
                and e.offset + e.length - cur[0].offset <= chunk_bytes):
            cur.append(e)
        else:
            runs.append([e])
    return runs


async def _check_run(backend: ObjectBackend, name: str, run: list[SegmentEntry], rep: FsckReport) -> None:
    start = run[0].offset
    buf = bytearray(run[-1].offset + run[-1].length - start)
    got = await backend.get_range(name, start, [memoryview(buf)])
    if got is None:
        rep.problems.append(FsckProblem(name, "data object vanished or is short", offset=start))
        return
    view = memoryview(buf)
    for e in run:
        try:
            verify_record(view[e.offset - start:e.offset - start + e.length], key=e.key)
        except RecordError as err:
            rep.problems.append(FsckProblem(name, f"{type(err).__name__}: {err}", e.key.hex(), e.offset))
            continue
        rep.records_ok += 1
        rep.bytes_verified += e.length


async def fsck_url(target: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, **s3_kwargs: Any) -> FsckReport:
    """Check ``target`` (``s3://bucket/prefix`` or ``file:///dir``): the legacy root layout and every
    ``ns/<hex>/`` namespace under it, in one report (object names carry their namespace prefix)."""
    backend = backend_from_url(target, **s3_kwargs)
    await backend.open()
    try:
        rep = await fsck_backend(backend, chunk_bytes=chunk_bytes)  # legacy root layout
        for ns in await list_namespaces(backend):  # and every ns/<hex>/ namespace
            sub = await fsck_backend(NamespaceView(backend, ns_prefix(bytes.fromhex(ns))), chunk_bytes=chunk_bytes)
            pre = ns_prefix(bytes.fromhex(ns))
            rep.manifests += sub.manifests
            rep.data_objects += sub.data_objects
            rep.records_ok += sub.records_ok
            rep.bytes_verified += sub.bytes_verified
            rep.orphans += [pre + o for o in sub.orphans]
            rep.quarantined += [pre + q for q in sub.quarantined]
            rep.problems += [FsckProblem(pre + p.object, p.error, p.key, p.offset) for p in sub.problems]
        for tenant, n in (await erased_records_left(backend)).items():
            why = f"tenant {tenant.hex()} was erased but {n} of its records are still listed"
            rep.problems.append(FsckProblem(f"{ERASURE_DIR}{tenant.hex()}.json", why))
        return rep
    finally:
        await backend.close()
