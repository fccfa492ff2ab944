"""G4 object tier: records in immutable data objects, found through per-object manifests.

* The index (key -> data object, offset, length) lives in memory and is rebuilt from the
  manifests at ``open()`` (and ``refresh()``), so ``contains``/``size_of``/``keys`` never do I/O
  and any node pointed at the bucket discovers what every other node stored. Everything else
  runs on the tier's event loop (the index's one writer); ``contains``/``size_of``/``keys``/
  ``usage`` are also called from engine threads and read a consistent generation of the index
  without a lock (``index.py``).
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
  sealed SSD segment file as-is (the flusher's path). Both live in ``writes.py``: data first,
  manifest second, and a published manifest never points at nothing.
* When a key is in several manifests (two nodes flushed the same prefix), the newest wins.
* Capacity: when live bytes exceed ``capacity_bytes`` the oldest objects are dropped (manifest
  deleted; the data becomes an orphan that ``gc`` removes after its grace period, so readers
  that still hold the old index keep working meanwhile). Tenants (``tenancy.py``): each
  tenant's live bytes and blocks are counted (``tenant_usage``); with quotas a tenant over its
  limit loses its own oldest objects, and a full namespace drops objects of tenants over their
  limit first. Every node enforces both on its own view of the bucket (docs/OBJECTS.md).
* Faults surface as ``TierUnavailable`` within ``read_timeout_s`` (plus the end of a local-directory
  pread already running); the store treats them as misses. The backend's retries share that
  budget (``retry.shared_deadline``): one stuck attempt takes its share, not all of it. When
  ``read_many`` returns or raises, none of its GETs can write into the callers' buffers any more
  (a failed read stops the rest). Under a restore's ``read_budget`` the read ends by the budget's
  deadline instead when that is sooner, and a read the backend expects to take longer than the
  time left (``expected_get_s``: recent GETs' first byte and throughput) is a miss at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator, Sequence

import numpy as np

from ...blocks.codec import verify_record
from ...blocks.keys import BlockKey
from ...errors import NamespaceMismatch, RecordError, TierUnavailable
from ...policy.quotas import TenantQuotas, holder_limit
from ..base import (
    ByteRange,
    ReadRequest,
    Tier,
    TierCapabilities,
    TierExpiry,
    TierUsage,
    check_range,
    current_read_budget,
)
from ..segments import SegmentEntry
from .backend import ObjectBackend
from .catalog import Catalog, Parsed, parse_manifest
from .expiry import adopt_retention, expire_pass, object_ranks, retained_classes
from .handles import IndexView, ObjectRef, Want, cancel_and_wait
from .index import release_free_heap
from .layout import SNAPSHOT_NAME, NamespaceView, manifest_after, ns_prefix
from .manifest import MANIFEST_DIR, Manifest, ManifestError
from .quarantine import new_marker, record_fails, write_marker
from .retry import DeadlineReached, detach_deadline, shared_deadline, with_timeout
from .sizing import window_piece_bytes
from .snapshot import SnapshotError
from .snapshot import decode as decode_snapshot
from .snapshot import encode as encode_snapshot
from .snapshot import fetch as fetch_snapshot
from .stats import ObjectTierStats
from .tenancy import capacity_victims
from .tenants import EraseReport, erase_in_view, read_erasures
from .writes import ObjectWrites

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_BYTES = 1 << 50  # the bucket is the bound; set a real budget in config
DEFAULT_TTL_S = 14 * 86400.0
LIST_LAG_MS = 120_000  # incremental listings re-cover 2 min: clock skew, manifests still in flight
INGEST_BATCH = 4096  # manifests fetched and indexed per step


class ObjectTier(ObjectWrites, Tier):
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
        quotas: per-tenant byte limits (``policy.quotas``; None or not ``enforced``: none), held
            on this node's view of the namespace (module docstring).
    """

    name = "object"
    capabilities = TierCapabilities(medium="object", durable=True, shared=True)
    #: a restore from this tier reads chunks of up to a staging slab (no small first chunk): 8 MiB
    #: chunks in 4 MiB pieces cost 13 GETs per 64 MiB prefix (`dtkv bench tiering`). The chunk
    #: does not follow the bucket: it holds a staging slab and is the unit read ahead
    #: (``load_depth``); how many GETs read it is the piece's business (``read_piece_bytes``).
    load_chunk_bytes: int | None = 64 << 20
    _piece_pin: int | None = None  # ``read_piece_bytes`` set by hand (tools, tests); None: sized

    @property
    def read_piece_bytes(self) -> int | None:
        """Smallest ranged GET a run of a restore's chunk is cut into: sized from the root
        backend's recent GETs so their first-byte latency is at most a tenth of each
        (``sizing.window_piece_bytes``: 8-64 MiB; 64 MiB until the window fills, or on a backend
        that keeps none). A value set on the tier replaces it (None: sized again). Any thread."""
        if self._piece_pin is not None:
            return self._piece_pin
        return window_piece_bytes(self.root_backend.latency)

    @read_piece_bytes.setter
    def read_piece_bytes(self, value: int | None) -> None:
        self._piece_pin = value

    #: loads into the caller's buffers (an engine's rows) read runs of records with ``read_split``:
    #: one ranged GET per run, its body scattered straight into the rows; cancellable at a deadline
    split_reads = True

    def __init__(self, backend: ObjectBackend, *, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 ttl_s: float | None = DEFAULT_TTL_S, verify_reads: bool = True, read_timeout_s: float = 30.0,
                 max_concurrency: int = 8, refresh_interval_s: float | None = None, origin: str = "",
                 namespace: bytes | None = None, snapshot_every: int = 64, full_refresh_every: int = 10,
                 read_legacy: bool = True, quotas: TenantQuotas | None = None) -> None:
        if capacity_bytes <= 0 or max_concurrency < 1 or read_timeout_s <= 0:
            raise ValueError("capacity_bytes, max_concurrency and read_timeout_s must be positive")
        self.root_backend = backend
        # a namespaced tier lives under ns/<hex>/ and never lists another namespace
        self.backend: ObjectBackend = NamespaceView(backend, ns_prefix(namespace)) if namespace else backend
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.verify_reads = verify_reads
        self.read_timeout_s = read_timeout_s
        self.max_concurrency = max_concurrency
        self.refresh_interval_s = refresh_interval_s
        self.origin = origin or f"{os.uname().nodename}:{os.getpid()}"
        self.namespace = namespace
        self.snapshot_every = snapshot_every
        self.full_refresh_every = full_refresh_every
        self.read_legacy = read_legacy and namespace is not None
        self.quotas = quotas if quotas is not None and quotas.enforced else None
        self.stats = ObjectTierStats()
        self._cat = Catalog(namespaced=namespace is not None)
        self._index = IndexView(self)
        self._fresh: list[Manifest] = []  # own publishes while the index builds (replayed on swap)
        self._suspect_data: set[str] = set()  # data objects with a record found corrupt here (writes.py)
        self._lock = asyncio.Lock()
        self._sem = asyncio.Semaphore(max_concurrency)
        self._refresher: asyncio.Task[None] | None = None
        self._starter: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[None]] = set()
        self._erasures: dict[bytes, float] = {}  # the bucket's tenant erasure markers, read on refresh
        self._backend_open = asyncio.Event()
        self._ready = asyncio.Event()
        self._since_snapshot = 0
        self.available = True

    def __repr__(self) -> str:
        return f"ObjectTier({self.backend!r}, objects={self._cat.objs.n}, blocks={len(self._cat)})"

    # --- index (memory only) --------------------------------------------------------------------
    @property
    def index_ready(self) -> bool:
        """True once the index holds the namespace's manifests (until then lookups miss)."""
        return self._ready.is_set()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the background index build finished; False on timeout."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return False
        return True

    def index_bytes(self) -> int:
        return self._cat.nbytes()

    def contains(self, key: BlockKey) -> bool:
        return self._cat.index.get(key) is not None

    def size_of(self, key: BlockKey) -> int | None:
        loc = self._cat.index.get(key)
        return None if loc is None else loc[2]

    def keys(self) -> Iterator[BlockKey]:
        return self._cat.index.keys()

    def usage(self) -> TierUsage:
        return TierUsage(self.capacity_bytes, self._cat.used, len(self._cat))

    def tenant_usage(self) -> dict[bytes, tuple[int, int]]:
        """Live record bytes and blocks of each tenant in this node's view of the namespace."""
        return self._cat.tenant_usage()

    def tenant_limit(self, tenant: str) -> int:
        """``Tier.tenant_limit``: the tenant's quota here (``tenant`` in hex), else the capacity."""
        return holder_limit(self.quotas, tenant, self.capacity_bytes)

    def location(self, key: BlockKey) -> tuple[str, SegmentEntry] | None:
        """(data object name, entry) of ``key``; for tools and tests."""
        loc = self._index.get(key)
        return None if loc is None else (loc[0].manifest.data, loc[1])

    def _forget(self, obj: ObjectRef) -> None:
        """Drop an object from the index (remote state untouched)."""
        if obj._cat is self._cat:
            self._cat.forget([obj.id])

    # --- lifecycle --------------------------------------------------------------------------------
    async def open(self) -> None:
        """Return at once: the backend opens and the index builds in the background. Until it is
        ready the tier serves misses and writes still work; no bucket size delays the caller."""
        if self._starter is None:
            self._starter = asyncio.create_task(self._start())

    async def _start(self) -> None:
        delay = 0.5
        while True:
            try:
                await self.root_backend.open()
                break
            except (TierUnavailable, OSError) as e:
                self.available = False
                log.warning("object tier %s cannot open (%s); retrying in %.0fs", self.backend.url, e, delay)
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)
        self._backend_open.set()
        delay = 0.5
        while True:
            try:
                await self._build()
                break
            except TierUnavailable as e:  # degrade: serve misses, keep trying
                self.available = False
                log.warning("object tier %s unavailable while indexing (%s); retrying in %.0fs",
                            self.backend.url, e, delay)
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)
        if self.refresh_interval_s and self._refresher is None:
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def _read_erasures(self) -> None:
        with contextlib.suppress(TierUnavailable, OSError):  # kept as known; read again next refresh
            self._erasures = await read_erasures(self.root_backend)

    def erasures(self) -> dict[bytes, float]:
        return dict(self._erasures)

    async def erase_tenant(self, tenant: bytes) -> int:
        """The tenant's records leave this namespace once more (a node may have flushed some between
        the command and this pass), then a full re-listing drops them from this node's index. The
        records of manifests the command already removed left the index at an earlier refresh."""
        rep = EraseReport(tenant.hex())
        await erase_in_view(self.backend, tenant, rep)
        await self.refresh(full=True)
        gone = [k for k in rep.keys if not self.contains(k)]
        self._report_evicted(gone)
        return len(gone)

    async def close(self) -> None:
        for t in (self._refresher, self._starter):
            if t is not None and not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        self._refresher = self._starter = None
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        if self._backend_open.is_set():
            await self.root_backend.close()

    async def _refresh_loop(self) -> None:
        assert self.refresh_interval_s
        n = 0
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            n += 1
            try:
                await self.refresh(full=n % self.full_refresh_every == 0)
            except TierUnavailable as e:
                log.debug("object tier refresh failed: %s", e)
            except Exception:
                # a bug in one pass must not end refreshing for the node's life (it would stop seeing
                # other nodes' writes and tenants' erasures); the next pass retries
                log.exception("object tier refresh failed; retrying in %.0f s", self.refresh_interval_s)
            await self._read_erasures()

    def _cutoff(self) -> float | None:
        return None if self.ttl_s is None else time.time() - self.ttl_s

    async def _build(self) -> None:
        """Snapshot (one GET) + manifests newer than it, or a full listing; then the legacy root."""
        t0 = time.monotonic()
        cat = Catalog(namespaced=self.namespace is not None)
        cutoff = self._cutoff()
        snap = await fetch_snapshot(self.backend, SNAPSHOT_NAME)
        if snap is not None:
            try:
                # nobody sees this catalog yet: decode and load off the event loop
                await asyncio.to_thread(lambda: cat.load_snapshot(decode_snapshot(snap), cutoff))
                self.stats.snapshot_loads += 1
            except SnapshotError as e:  # never trusted: rebuilt from the manifests
                self.stats.snapshot_rejected += 1
                log.warning("ignoring index snapshot of %s: %s", self.backend.url, e)
                cat = Catalog(namespaced=self.namespace is not None)
            snap = None  # hundreds of MB at 10M blocks: not kept through the listing below
        await self._ingest_listing(cat, incremental=cat.objs.n > 0, private=True)
        if self.read_legacy:
            legacy = [o.name for o in await self.root_backend.list(MANIFEST_DIR) if o.name.endswith(".json")]
            known = cat.names(root=True)
            await self._ingest(cat, [n for n in legacy if n not in known], root=True, private=True)
        await asyncio.to_thread(cat.finish)
        async with self._lock:
            for m in self._fresh:
                cat.add_fresh(m.name, m.data, m.created_at, ((e.key, e.offset, e.length, e.tenant) for e in m.entries))
            # then the exclusions as they stand now (a write after a delete already lifted its
            # own): a key deleted after this node wrote it stays deleted
            for key in self._cat.excl_key:
                cat.exclude_key(key)
            for key, locs in self._cat.excl_loc.items():
                for data, offset in locs:
                    cat.exclude(key, data, offset)
            self._cat, self._fresh = cat, []
            adopt_retention(self._retention, cat)
            self._enforce_capacity_locked()
        await asyncio.to_thread(release_free_heap)  # the build's garbage, before it counts as ours
        await self._read_erasures()  # part of the index: a started node knows them when it is ready
        self._ready.set()
        self.available = True
        self.stats.index_build_s = time.monotonic() - t0
        log.info("object tier %s indexed %d blocks in %.2fs", self.backend.url, len(cat), self.stats.index_build_s)

    async def refresh(self, *, full: bool = True) -> None:
        """Pick up other nodes' manifests. ``full`` lists the whole namespace prefix and also drops
        manifests deleted elsewhere; otherwise only names newer than the newest seen (minus
        ``LIST_LAG_MS`` for clock skew) are listed (``StartAfter``).

        Raises:
            TierUnavailable: the store cannot be listed.
        """
        if not self._ready.is_set():
            if self._starter is None:
                await self.open()
            await self._ready.wait()
            return
        await self._ingest_listing(self._cat, incremental=not full, private=False)
        self.available = True

    async def _ingest_listing(self, cat: Catalog, *, incremental: bool, private: bool) -> None:
        if incremental:
            since = cat.watermark_ms - LIST_LAG_MS
            listed = await self.backend.list(MANIFEST_DIR, start_after=manifest_after(since))
            known = cat.names(since)
        else:
            listed = await self.backend.list(MANIFEST_DIR)
            known = cat.names()
        names = {o.name for o in listed if o.name.endswith(".json")}
        if not incremental:  # deleted elsewhere (gc, another node's eviction)
            gone = [i for n, i in known.items() if n not in names]
            if gone:
                async with self._lock:
                    cat.forget(gone)
        await self._ingest(cat, sorted(n for n in names if n not in known), root=False, private=private)

    async def _ingest(self, cat: Catalog, names: list[str], *, root: bool, private: bool) -> None:
        """Fetch manifests (``max(16, max_concurrency)`` at a time) and index them in batches."""
        be = self.root_backend if root else self.backend
        sem = asyncio.Semaphore(max(16, self.max_concurrency))
        cutoff = self._cutoff()

        async def fetch(n: str) -> tuple[str, Parsed | None]:
            async with sem:
                raw = await be.get_bytes(n)
            if raw is None:
                return n, None
            try:
                return n, parse_manifest(raw)
            except ManifestError as e:
                log.warning("ignoring manifest %s: %s", n, e)
                return n, None

        for i in range(0, len(names), INGEST_BATCH):
            got = [g for g in await asyncio.gather(*(fetch(n) for n in names[i:i + INGEST_BATCH]))
                   if g[1] is not None]
            if private:  # nobody else sees this catalog yet: collect off the event loop, index once
                await asyncio.to_thread(functools.partial(cat.add_parsed, got, cutoff=cutoff, root=root, defer=True))
            else:
                async with self._lock:
                    cat.add_parsed(got, cutoff=cutoff, root=root)
                    adopt_retention(self._retention, cat)
                    self._enforce_capacity_locked()

    async def write_snapshot(self) -> bool:
        """Publish this node's compacted index as the namespace's snapshot (only when complete)."""
        if not self._ready.is_set():
            return False
        async with self._lock:
            snap = self._cat.to_snapshot(retained_classes(self._retention))
        raw = await asyncio.to_thread(encode_snapshot, snap)
        await self.backend.put_object(SNAPSHOT_NAME, raw)
        self._since_snapshot = 0
        self.stats.snapshots_written += 1
        return True

    # --- reads ----------------------------------------------------------------------------------
    async def read_into(self, key: BlockKey, into: memoryview, byte_range: ByteRange | None = None) -> int | None:
        return (await self.read_many([ReadRequest(key, into, byte_range)]))[0]

    async def read_many(self, requests: Sequence[ReadRequest]) -> list[int | None]:
        results: list[int | None] = [None] * len(requests)
        by_obj: dict[str, tuple[ObjectRef, list[Want]]] = {}
        for i, r in enumerate(requests):
            loc = self._index.get(r.key)
            if loc is None:
                continue
            obj, e = loc
            off, n = check_range(e.length, r.into, r.byte_range)
            whole = r.byte_range is None or (off == 0 and n == e.length)
            by_obj.setdefault(obj.manifest.data, (obj, []))[1].append(
                Want(e.offset + off, n, i, r.into[:n], r.key, whole))
        runs: list[tuple[ObjectRef, list[Want]]] = []
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
        budget = current_read_budget()
        limit = self.read_timeout_s if budget is None else min(self.read_timeout_s, budget.deadline - time.monotonic())
        if budget is not None and (limit <= 0 or self._expected_s(runs) > limit):
            budget.gave_up = budget.gave_up or ("budget" if limit <= 0 else "estimate")
            return results  # recomputing is sooner: no GET sent
        # the backend's retries share this call's budget: a silent connection costs one attempt's share
        with shared_deadline(limit):
            tasks = [asyncio.ensure_future(self._read_run(o, run, results)) for o, run in runs]
            try:
                await with_timeout(asyncio.gather(*tasks), limit)
            except BaseException as e:
                # The runs scatter into the callers' buffers, which the caller reuses once we raise:
                # stop every run and wait until none of them can write any more.
                await cancel_and_wait(tasks)
                timed_out = isinstance(e, (asyncio.TimeoutError, TimeoutError))
                if budget is not None and limit < self.read_timeout_s and (timed_out or isinstance(e, DeadlineReached)):
                    budget.gave_up = "budget"
                if timed_out:
                    raise TierUnavailable(f"object tier read timed out after {limit:.3g}s") from None
                raise
        return results

    def _expected_s(self, runs: list[tuple[ObjectRef, list[Want]]]) -> float:
        """Expected time of ``runs`` (one GET each, ``max_concurrency`` at a time); 0 when unknown."""
        longest = max(sum(w.length for w in run) for _, run in runs)
        one = self.root_backend.expected_get_s(longest)
        return 0.0 if one is None else one * -(-len(runs) // self.max_concurrency)

    async def _read_run(self, obj: ObjectRef, run: list[Want], results: list[int | None]) -> None:
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

    async def _reread(self, data: str, w: Want, first: RecordError) -> tuple[RecordError | None, bool]:
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
        self._cat.exclude(key, data, offset)

    async def _quarantine(self, key: BlockKey, data: str, offset: int, length: int, reason: str) -> None:
        self._suspect_data.add(data)  # never reused for an upload, even if the marker cannot be written
        await write_marker(self.backend, new_marker(data, offset, length, key, reason, self.origin))
        self.stats.quarantined += 1
        log.warning("quarantined record %s at %s@%d (%s); dtkv gc resolves it", key.hex(), data, offset, reason)

    async def expire(self, now: float, max_bytes: int) -> TierExpiry:
        """One in-process GC pass (``expiry.expire_pass``): retained blocks whose expiry passed,
        objects past the TTL that hold no protected block, and the manifests left without a live
        block."""
        rep = await expire_pass(self, now=now, max_bytes=max_bytes)
        return TierExpiry(rep.blocks, rep.bytes)

    async def delete(self, key: BlockKey) -> bool:
        """Stop serving ``key`` on this node; shared objects are never changed.

        The store calls this when a record failed verification. The record is read once more: if
        that read fails key-only verification too, a quarantine marker reports it to ``dtkv gc``
        (which decides for every node); if it verifies, the first failure was in transit, or the
        record belongs to another namespace, and nothing is reported.
        """
        async with self._lock:
            loc = self._index.get(key)
            self._cat.exclude_key(key)  # every copy, until this node writes the key again
        if loc is None:
            return False
        data, e = loc[0].manifest.data, loc[1]
        try:
            with shared_deadline(self.read_timeout_s):
                why = await with_timeout(record_fails(self.backend, data, e.offset, e.length, key, reads=1),
                                         self.read_timeout_s)
            if why is not None:
                await self._quarantine(key, data, e.offset, e.length, why)
        except (TierUnavailable, asyncio.TimeoutError, TimeoutError) as err:
            log.warning("could not re-check record %s at %s@%d: %s", key.hex(), data, e.offset, err)
        return True

    def _enforce_capacity_locked(self) -> None:
        """Drop objects past the capacity and, with quotas, past tenants' limits (``tenancy.py``)."""
        cat = self._cat
        if cat.used <= self.capacity_bytes and (self.quotas is None or not cat.tenants.over(self.quotas)):
            return
        victims = capacity_victims(cat.tenants, cat.objs.view, cat.used, self.capacity_bytes, self.quotas,
                                   object_ranks(self._retention, cat))
        if not len(victims):
            return
        names = [cat.manifest_name(int(i)) for i in victims]
        gone = cat.index.keys_of(np.asarray(victims, dtype=np.int64)) if self._residency_hook is not None else []
        cat.forget(victims)
        self.stats.evicted_objects += len(names)
        self._report_evicted(gone)
        for n in names:
            self._spawn(self.backend.delete(n))  # data is left for gc (grace period)

    def _spawn(self, coro) -> None:
        async def guarded() -> None:
            detach_deadline()  # spawned by a read, it is not bounded by that read's budget
            try:
                await coro
            except TierUnavailable as e:
                log.debug("background delete failed (gc will retry): %s", e)

        task = asyncio.get_running_loop().create_task(guarded())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
