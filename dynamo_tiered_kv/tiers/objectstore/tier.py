"""G4 object tier: records in immutable data objects, found through per-object manifests.

* The index (key -> data object, offset, length) lives in memory and is rebuilt from the
  manifests at ``open()`` (and ``refresh()``), so ``contains``/``size_of``/``keys`` never do I/O
  and any node pointed at the bucket discovers what every other node stored.
* ``read_many`` groups requests by data object and coalesces byte-contiguous ones into ONE ranged
  GET scattered into the callers' buffers: restoring a prefix costs one GET per contiguous run.
  Whole-record reads are verified (``codec.verify_record``: key, and the namespace when given);
  a record that fails is read once more, and if it fails again it is a miss, counted in
  ``stats.corrupt_reads``, and never served by this node.
* Shared state is never changed because of a read: ``delete`` (what the store calls after a
  failed verification) and read failures only exclude the record from *this node's* index; a
  record that fails a fresh re-read too gets a quarantine marker (``quarantine.py``) that
  ``dtkv gc`` resolves. ``write_many`` never rewrites other manifests either.
* ``write_many`` packs a run into one data object + manifest; ``publish_segment`` uploads a
  sealed SSD segment file as-is (the flusher's path). Both publish data first, manifest second,
  clear the data's GC tombstone, and check the data still exists after the manifest is visible
  (re-uploading it if GC deleted it meanwhile): a published manifest never points at nothing.
* When a key is in several manifests (two nodes flushed the same prefix), the newest wins.
* Capacity: when live bytes exceed ``capacity_bytes`` the oldest objects are dropped (manifest
  deleted; the data becomes an orphan that ``gc`` removes after its grace period, so readers
  that still hold the old index keep working meanwhile).
* Faults surface as ``TierUnavailable`` within ``read_timeout_s`` (plus the end of a local-directory
  pread already running); the store treats them as misses. When ``read_many`` returns or raises,
  none of its GETs can write into the callers' buffers any more (a failed read stops the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...codec import verify_record
from ...errors import NamespaceMismatch, RecordError, TierFull, TierUnavailable
from ...keys import BlockKey
from ..base import ByteRange, ReadRequest, Tier, TierCapabilities, TierUsage, check_range
from ..segments import SealedSegment, SegmentEntry
from .backend import FileSource, ObjectBackend
from .manifest import MANIFEST_DIR, Manifest, ManifestError, content_digest, data_name, tombstone_name
from .quarantine import new_marker, record_fails, write_marker
from .retry import with_timeout

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_BYTES = 1 << 50  # the bucket is the bound; set a real budget in config
DEFAULT_TTL_S = 14 * 86400.0


@dataclass
class ObjectTierStats:
    """Counters for metrics (monotonic)."""

    gets: int = 0  # ranged GETs issued by read_many
    runs: int = 0  # contiguous runs read (== gets)
    records_read: int = 0
    corrupt_reads: int = 0  # records that failed verification twice (never served)
    reread_ok: int = 0  # records that failed once and verified on the re-read (served)
    quarantined: int = 0  # quarantine markers written
    missing_objects: int = 0
    objects_published: int = 0
    objects_deduplicated: int = 0  # publish found the data already there (another node)
    evicted_objects: int = 0
    reuploaded_objects: int = 0  # data deleted (by gc) between our data and manifest puts


@dataclass
class _Obj:
    name: str  # manifest object name
    manifest: Manifest
    live: dict[BlockKey, SegmentEntry] = field(default_factory=dict)


@dataclass
class _Want:
    offset: int  # absolute offset in the data object
    length: int
    index: int  # position in the request list
    dest: memoryview
    key: BlockKey
    whole: bool  # a whole record (verifiable)


class ObjectTier(Tier):
    """The object tier over an ``ObjectBackend`` (S3 or a local directory).

    Args:
        backend: where objects live; the tier opens and closes it.
        capacity_bytes: bound on live record bytes; the oldest objects go first.
        ttl_s: manifests older than this are ignored at open/refresh (``gc`` deletes them);
            None keeps everything.
        verify_reads: verify whole records on read (a failure is a miss, never served).
        read_timeout_s: bound of one ``read_many`` call; past it ``TierUnavailable`` is raised.
        max_concurrency: ranged GETs (and manifest fetches) in flight at once.
        refresh_interval_s: if set, re-list manifests in the background to pick up other nodes'
            objects; otherwise call ``refresh()``.
        origin: tag written into manifests (node name), for operators.
        namespace: expected namespace digest of every record; verifying reads then check the
            full identity (a foreign tenant's record with the same key bytes is a miss).
    """

    name = "object"
    capabilities = TierCapabilities(medium="object", durable=True, shared=True)

    def __init__(self, backend: ObjectBackend, *, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 ttl_s: float | None = DEFAULT_TTL_S, verify_reads: bool = True, read_timeout_s: float = 30.0,
                 max_concurrency: int = 8, refresh_interval_s: float | None = None, origin: str = "",
                 namespace: bytes | None = None) -> None:
        if capacity_bytes <= 0 or max_concurrency < 1 or read_timeout_s <= 0:
            raise ValueError("capacity_bytes, max_concurrency and read_timeout_s must be positive")
        self.backend = backend
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.verify_reads = verify_reads
        self.read_timeout_s = read_timeout_s
        self.max_concurrency = max_concurrency
        self.refresh_interval_s = refresh_interval_s
        self.origin = origin or f"{os.uname().nodename}:{os.getpid()}"
        self.namespace = namespace
        self.stats = ObjectTierStats()
        self._objs: dict[str, _Obj] = {}
        self._index: dict[BlockKey, tuple[_Obj, SegmentEntry]] = {}
        self._holders: dict[BlockKey, set[str]] = {}  # key -> manifests listing it
        self._used = 0
        self._lock = asyncio.Lock()
        self._sem = asyncio.Semaphore(max_concurrency)
        self._refresher: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[None]] = set()
        self._expired: set[str] = set()  # manifests past their TTL: not indexed, not refetched
        # (data object, offset) per key that this node no longer serves (delete, failed reads);
        # local only, so one node's bad read never removes shared data for the others
        self._excluded: dict[BlockKey, set[tuple[str, int]]] = {}
        self.available = True

    def __repr__(self) -> str:
        return f"ObjectTier({self.backend!r}, objects={len(self._objs)}, blocks={len(self._index)})"

    # --- index (memory only) --------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def size_of(self, key: BlockKey) -> int | None:
        loc = self._index.get(key)
        return None if loc is None else loc[1].length

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._index))

    def usage(self) -> TierUsage:
        return TierUsage(self.capacity_bytes, self._used, len(self._index))

    def location(self, key: BlockKey) -> tuple[str, SegmentEntry] | None:
        """(data object name, entry) of ``key``; for tools and tests."""
        loc = self._index.get(key)
        return None if loc is None else (loc[0].manifest.data, loc[1])

    def _add(self, name: str, m: Manifest) -> None:
        obj = self._objs.get(name)
        if obj is None:
            obj = self._objs[name] = _Obj(name, m)
        for e in m.entries:
            self._holders.setdefault(e.key, set()).add(name)
            if (m.data, e.offset) in self._excluded.get(e.key, ()):
                continue
            cur = self._index.get(e.key)
            if cur is not None:
                if cur[0] is obj or cur[0].manifest.created_at > m.created_at:
                    continue
                self._unlink(e.key)
            self._index[e.key] = (obj, e)
            obj.live[e.key] = e
            self._used += e.length

    def _unlink(self, key: BlockKey) -> None:
        """Drop ``key`` from the index (its manifests are untouched)."""
        loc = self._index.pop(key, None)
        if loc is not None:
            loc[0].live.pop(key, None)
            self._used -= loc[1].length

    def _forget(self, obj: _Obj) -> None:
        """Drop an object from the index (remote state untouched)."""
        self._objs.pop(obj.name, None)
        for e in obj.manifest.entries:
            hs = self._holders.get(e.key)
            if hs is not None:
                hs.discard(obj.name)
                if not hs:
                    del self._holders[e.key]
        for k in list(obj.live):
            self._unlink(k)

    # --- lifecycle --------------------------------------------------------------------------------
    async def open(self) -> None:
        await self.backend.open()
        try:
            await self.refresh()
        except TierUnavailable as e:  # degrade: start empty, serve misses, retry on refresh
            self.available = False
            log.warning("object tier %s unavailable at open (%s); starting empty", self.backend.url, e)
        if self.refresh_interval_s and self._refresher is None:
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        await self.backend.close()

    async def _refresh_loop(self) -> None:
        assert self.refresh_interval_s
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except TierUnavailable as e:
                log.debug("object tier refresh failed: %s", e)

    async def refresh(self) -> None:
        """Reconcile the index with the manifests in the store (other nodes' work included).

        Raises:
            TierUnavailable: the store cannot be listed.
        """
        listed = await self.backend.list(MANIFEST_DIR)
        names = {o.name for o in listed if o.name.endswith(".json")}
        self._expired &= names
        new = [n for n in names if n not in self._objs and n not in self._expired]
        fetched = await asyncio.gather(*(self._fetch_manifest(n) for n in new))
        cutoff = None if self.ttl_s is None else time.time() - self.ttl_s
        async with self._lock:
            for obj in [o for n, o in self._objs.items() if n not in names]:
                self._forget(obj)  # deleted elsewhere (gc, another node's delete)
            for n, m in sorted(zip(new, fetched), key=lambda nm: nm[1].created_at if nm[1] else 0.0):
                if m is None:
                    continue
                if cutoff is not None and m.created_at < cutoff:
                    self._expired.add(n)
                else:
                    self._add(n, m)
            self._enforce_capacity_locked()
        self.available = True

    async def _fetch_manifest(self, name: str) -> Manifest | None:
        async with self._sem:
            raw = await self.backend.get_bytes(name)
        if raw is None:
            return None
        try:
            return Manifest.from_bytes(raw)
        except ManifestError as e:
            log.warning("ignoring manifest %s: %s", name, e)
            return None

    # --- reads ----------------------------------------------------------------------------------
    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        return (await self.read_many([ReadRequest(key, into, byte_range)]))[0]

    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        results: list[int | None] = [None] * len(requests)
        by_obj: dict[str, tuple[_Obj, list[_Want]]] = {}
        for i, r in enumerate(requests):
            loc = self._index.get(r.key)
            if loc is None:
                continue
            obj, e = loc
            off, n = check_range(e.length, r.into, r.byte_range)
            whole = r.byte_range is None or (off == 0 and n == e.length)
            by_obj.setdefault(obj.manifest.data, (obj, []))[1].append(
                _Want(e.offset + off, n, i, r.into[:n], r.key, whole))
        runs: list[tuple[_Obj, list[_Want]]] = []
        for obj, wants in by_obj.values():
            wants.sort(key=lambda w: w.offset)
            run = [wants[0]]
            for w in wants[1:]:
                if w.offset == run[-1].offset + run[-1].length:
                    run.append(w)
                else:
                    runs.append((obj, run))
                    run = [w]
            runs.append((obj, run))
        if not runs:
            return results
        tasks = [asyncio.ensure_future(self._read_run(o, run, results)) for o, run in runs]
        try:
            await with_timeout(asyncio.gather(*tasks), self.read_timeout_s)
        except BaseException as e:
            # The runs scatter into the callers' buffers, which the caller reuses once we raise:
            # stop every run and wait until none of them can write any more.
            await _cancel_and_wait(tasks)
            if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
                raise TierUnavailable(f"object tier read timed out after {self.read_timeout_s}s") from None
            raise
        return results

    async def _read_run(self, obj: _Obj, run: list[_Want], results: list[int | None]) -> None:
        async with self._sem:
            got = await self.backend.get_range(obj.manifest.data, run[0].offset, [w.dest for w in run])
        self.stats.gets += 1
        self.stats.runs += 1
        if got is None:
            self.stats.missing_objects += 1
            log.warning("data object %s is gone; dropping %d keys", obj.manifest.data, len(obj.live))
            self._forget(obj)
            return
        for w in run:
            if self.verify_reads and w.whole:
                bad = self._check(w.dest, w.key)
                if bad is not None:  # believe it only if a fresh read fails too (bits flip in transit)
                    bad, sure = await self._reread(obj.manifest.data, w, bad)
                    if bad is None:
                        self.stats.reread_ok += 1
                if bad is not None:
                    self.stats.corrupt_reads += 1
                    log.warning("corrupt record %s in %s: %s", w.key.hex(), obj.manifest.data, bad)
                    self._exclude(w.key, obj.manifest.data, w.offset)
                    if sure and not isinstance(bad, NamespaceMismatch):  # a foreign record is fine as such
                        self._spawn(self._quarantine(w.key, obj.manifest.data, w.offset, w.length,
                                                     f"{type(bad).__name__}: {bad}"))
                    continue
            results[w.index] = w.length
            self.stats.records_read += 1

    def _check(self, view: memoryview, key: BlockKey) -> RecordError | None:
        try:
            verify_record(view, namespace=self.namespace, key=key)
        except RecordError as e:
            return e
        return None

    async def _reread(self, data: str, w: _Want, first: RecordError) -> tuple[RecordError | None, bool]:
        """Read ``w`` again. Returns (error or None, whether the outcome is certain: False when
        the re-read could not be done, so the first failure stands but is not confirmed)."""
        try:
            async with self._sem:
                got = await self.backend.get_range(data, w.offset, [w.dest])
        except TierUnavailable:
            return first, False
        if got is None:
            return first, False
        return self._check(w.dest, w.key), True

    def _exclude(self, key: BlockKey, data: str, offset: int) -> None:
        """Stop serving ``key`` at this location on this node (nothing remote changes)."""
        self._excluded.setdefault(key, set()).add((data, offset))
        loc = self._index.get(key)
        if loc is not None and loc[0].manifest.data == data and loc[1].offset == offset:
            self._unlink(key)

    async def _quarantine(self, key: BlockKey, data: str, offset: int, length: int, reason: str) -> None:
        await write_marker(self.backend, new_marker(data, offset, length, key, reason, self.origin))
        self.stats.quarantined += 1
        log.warning("quarantined record %s at %s@%d (%s); dtkv gc resolves it", key.hex(), data, offset, reason)

    # --- writes ---------------------------------------------------------------------------------
    async def write(self, key: BlockKey, data: memoryview) -> None:
        await self.write_many([(key, data)])

    async def write_many(self, items: Iterable[tuple[BlockKey, memoryview]]) -> None:
        """Pack the run into one data object (later duplicates of a key win) and publish it."""
        last: dict[BlockKey, memoryview] = {}
        for k, v in items:
            last.pop(k, None)
            last[k] = memoryview(v).cast("B")
        if not last:
            return
        total = sum(v.nbytes for v in last.values())
        if total > self.capacity_bytes:
            raise TierFull(f"{total} bytes exceed the object tier capacity {self.capacity_bytes}")
        buf = bytearray(total)
        entries: list[SegmentEntry] = []
        pos = 0
        for k, v in last.items():
            if v.nbytes == 0:
                raise ValueError("cannot store an empty record")
            buf[pos:pos + v.nbytes] = v
            entries.append(SegmentEntry(k, pos, v.nbytes))
            pos += v.nbytes
        digest = content_digest(total, entries, lambda o, n: bytes(buf[o:o + n]))
        m = await self._publish(digest, memoryview(buf), total, tuple(entries), self.origin)
        async with self._lock:
            # Other manifests listing these keys are left alone (they may be other nodes' only
            # copy of the rest of their records); the newest manifest wins in every index.
            self._add_fresh(m)
            self._enforce_capacity_locked()

    async def publish_segment(self, seg: SealedSegment) -> Manifest:
        """Upload a sealed segment file as one data object plus its manifest (idempotent).

        Raises:
            TierUnavailable: the store failed; nothing half-written is visible.
            OSError: the segment file could not be read.
        """
        digest = await asyncio.to_thread(_file_digest, seg.path, seg.size, seg.entries)
        m = await self._publish(digest, FileSource(Path(seg.path), seg.size), seg.size, seg.entries,
                                f"{self.origin}/{seg.segment_id}")
        async with self._lock:
            self._add_fresh(m)
            self._enforce_capacity_locked()
        return m

    def _add_fresh(self, m: Manifest) -> None:
        """Index what this node just published; it lifts this node's exclusions of those keys."""
        for e in m.entries:
            self._excluded.pop(e.key, None)
        self._add(m.name, m)

    async def _publish(self, digest: str, src: memoryview | FileSource, size: int,
                       entries: tuple[SegmentEntry, ...], origin: str) -> Manifest:
        dname = data_name(digest)
        if await self.backend.put_object(dname, src, if_absent=True):
            self.stats.objects_published += 1
        else:
            self.stats.objects_deduplicated += 1
            # It may be an orphan that gc tombstoned: clear the tombstone before our manifest
            # exists, so a gc that checks it before deleting spares the object.
            await self.backend.delete(tombstone_name(dname))
        m = Manifest(dname, size, time.time(), entries, origin)
        await self.backend.put_object(m.name, m.to_bytes(), if_absent=True)  # only after the data
        # A gc that listed manifests before ours existed may have deleted the data meanwhile:
        # check now that the manifest is visible (later gc runs see it) and upload again if so.
        for _ in range(3):
            if await self.backend.head(dname) is not None:
                return m
            log.warning("data object %s vanished while publishing (gc race); uploading it again", dname)
            self.stats.reuploaded_objects += 1
            await self.backend.put_object(dname, src, if_absent=True)
        raise TierUnavailable(f"data object {dname} keeps vanishing after upload")

    async def delete(self, key: BlockKey) -> bool:
        """Stop serving ``key`` on this node; shared objects are never changed.

        The store calls this when a record failed verification. The record is read once more: if
        that read fails key-only verification too, a quarantine marker reports it to ``dtkv gc``
        (which decides for every node); if it verifies, the first failure was in transit, or the
        record belongs to another namespace, and nothing is reported.
        """
        async with self._lock:
            loc = self._index.get(key)
            for n in self._holders.get(key, ()):
                o = self._objs.get(n)
                for e in o.manifest.entries if o is not None else ():
                    if e.key == key:
                        self._excluded.setdefault(key, set()).add((o.manifest.data, e.offset))
            self._unlink(key)
        if loc is None:
            return False
        data, e = loc[0].manifest.data, loc[1]
        try:
            why = await with_timeout(record_fails(self.backend, data, e.offset, e.length, key, reads=1),
                                     self.read_timeout_s)
            if why is not None:
                await self._quarantine(key, data, e.offset, e.length, why)
        except (TierUnavailable, asyncio.TimeoutError, TimeoutError) as err:
            log.warning("could not re-check record %s at %s@%d: %s", key.hex(), data, e.offset, err)
        return True

    def _enforce_capacity_locked(self) -> None:
        if self._used <= self.capacity_bytes:
            return
        for obj in sorted(self._objs.values(), key=lambda o: o.manifest.created_at):
            if self._used <= self.capacity_bytes:
                break
            self._forget(obj)
            self.stats.evicted_objects += 1
            self._spawn(self.backend.delete(obj.name))  # data is left for gc (grace period)

    def _spawn(self, coro) -> None:
        async def guarded() -> None:
            try:
                await coro
            except TierUnavailable as e:
                log.debug("background delete failed (gc will retry): %s", e)

        task = asyncio.get_running_loop().create_task(guarded())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)


def _file_digest(path: os.PathLike[str], size: int, entries: Sequence[SegmentEntry]) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise OSError(f"{path} holds {actual} bytes, segment says {size}")
        return content_digest(size, entries, lambda o, n: os.pread(fd, n, o))
    finally:
        os.close(fd)


async def _cancel_and_wait(tasks: list[asyncio.Future[None]]) -> None:
    """Cancel ``tasks`` and wait until every one has finished, even if we are cancelled meanwhile."""
    for t in tasks:
        t.cancel()
    cancelled = False
    while not all(t.done() for t in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            cancelled = True
    for t in tasks:  # mark their outcomes retrieved (the caller raises its own error)
        if not t.cancelled():
            t.exception()
    if cancelled:
        raise asyncio.CancelledError
