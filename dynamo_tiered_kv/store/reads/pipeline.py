"""The restore pipeline of ``TieredStore.load``: chunks read on the store's loop, verified and
scattered on the calling thread, several chunks in flight.

* A load is cut into chunks: a small first one (decode starts after ~1 MiB has arrived, not a
  whole chunk), then ``load_chunk_bytes`` each; where every block comes from tiers that name
  their own ``load_chunk_bytes`` (host memory: nothing to overlap; the object tier: a request
  costs more than the overlap gains), chunks of that size (up to a slab) from the first. A load
  of at most one chunk is read without the loop where its tier can (``read_slab_now``: one
  hand-off to a helper thread the caller waits for until the deadline; on the calling thread
  when the load has none), in two parts when large enough, the second read while the first is
  verified (``store.reads.direct``). Up to ``load_depth`` chunks are read ahead,
  each into its own staging slab taken without waiting (one slab is left free for offloads).
* Within a chunk, every run of blocks whose fastest tier is the same is cut into up to the
  tier's read parallelism pieces (``read_parallelism``, or the object tier's ``max_concurrency``)
  read concurrently with one ``read_many`` each; one wake-up of the caller per chunk.
* Host-tier chunks of CPU layouts are verified and scattered straight from the host arena
  (records pinned against eviction meanwhile): no copy into a slab at all.
* A CUDA layout's load is one ``device_copy.RestoreSession``: every chunk's scatter waits for one
  engine mark (the caller's ``restore_after``, else the load's start), and a chunk's copy runs
  while the next chunk is verified; a slab goes back to the pool once the copies reading it are
  done (the host waits only when this load needs a slab it still holds, or at the end).
* If the caller stops waiting (timeout, an earlier chunk failed), the reader frees the slab when
  its I/O returns, so no tier ever writes into a slab that was handed out again (failure rule 6).
* With ``recompute_tokens_per_s`` set, a restore never waits on the object tier longer than
  recomputing would take (``budget.py``). The tier gives up by then, or at once when it expects
  its GETs to take longer; the engine recomputes those blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...blocks.codec import decode_blocks, decode_records, record_bytes, verify_is_compiled
from ...blocks.keys import BlockKey
from ...blocks.layout import EngineLayout
from ...errors import stalled_read
from ...policy.pacing import SLICE_BYTES, Pacer
from ...staging.device_copy import RestoreSession
from ...staging.device_slabs import DeviceSlab
from ...staging.slabs import Slab, StagingPool
from ...tiers.base import ReadBudget, ReadRequest, Tier, read_budget
from .budget import abandon_reason, restore_budget
from .chunk import ChunkRead, Handoff, slot_view
from .direct import DirectReader, first_part
from .fanout import fan_out
from .stages import LoadStages, union_length

if TYPE_CHECKING:
    from ...policy.admission import Admission
    from ..state import StoreState
    from ..writes import OffloadWriter

log = logging.getLogger("dynamo_tiered_kv.store")  # same logger as before the split: log filters keep working

MIN_PIECE_BYTES = 4 << 20  # smaller concurrent reads cost more per request than they gain (S3: 1 MiB ran 4x slower)
#: a load up to this size (and one staging slab) from one tier that reads on the calling thread
#: (``read_slab_now``) is one chunk read there: a 2k-token prefix (15 MiB at 8 KiB/token) read as
#: three chunks through the loop spent more in hand-offs between chunks than verify+scatter
#: overlapping the reads saved (docs/BENCHMARKS.md, "Restore fixed costs")
LOAD_DIRECT_BYTES = 16 << 20


class _ChunkDecoder:
    """Runs a chunk's verify+scatter: in slices, each admitted by the load's pacer, while it limits
    the restore's CPU; else, for layouts the compiled decoder handles (a CUDA layout's: its
    compiled host verify), fanned out over a few threads (``store.reads.fanout``)."""

    def __init__(self, pacer: Pacer | None, deadline: float | None, rb: int, ways: int | None) -> None:
        self.pacer, self.deadline, self.rb, self.ways = pacer, deadline, rb, ways
        self.per_slice = max(1, SLICE_BYTES // rb)
        self.waited_s = 0.0

    def __call__(self, n: int, decode: Callable[[int, int], list[Any]]) -> list[Any]:
        """``decode(a, b)`` verifies+scatters records ``a:b``; the errors of all ``n``, in order."""
        if not n:
            return []
        if self.pacer is None or not self.pacer.limiting():
            return decode(0, n) if self.ways == 1 else fan_out(n, self.rb, decode, self.ways)
        out: list[Any] = []
        for a in range(0, n, self.per_slice):
            t0 = time.perf_counter()
            self.pacer.admit(self.deadline)
            self.waited_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                out += decode(a, min(n, a + self.per_slice))
            finally:
                self.pacer.spent(time.perf_counter() - t0)
        return out


class ChunkReader:
    """The restore pipeline (module docstring): the store's reader.

    Built by ``TieredStore`` with the shared ``StoreState`` (tiers, metrics, loop, condemned
    records, pending promotions), the staging pool, the writer (slab choice, promotions into
    faster tiers) and the admission policy (which tiers a loaded block is promoted into).
    Threads: ``load_pipelined`` and the verify+scatter run on the calling (loading) thread, the
    chunk reads on the store's loop or a ``dtkv-readnow`` helper; ``_read_gates`` is the loop's.

    ``recompute_tokens_per_s``: the engine's prefill rate, which bounds object-tier reads (module
    docstring); None: off. Set once before loads start (``factory.build_store``).
    """

    recompute_tokens_per_s: float | None = None

    def __init__(self, state: StoreState, staging: StagingPool, writer: OffloadWriter, admission: Admission, *,
                 write_depth: int, ns_digest: bytes, load_chunk_bytes: int, load_first_chunk_bytes: int,
                 load_depth: int, load_direct_bytes: int = LOAD_DIRECT_BYTES) -> None:
        self._state = state
        self.tiers = state.tiers
        self.metrics = state.metrics
        self.staging = staging
        self._writer = writer
        self.admission = admission
        self.write_depth = write_depth
        self._ns_digest = ns_digest
        self.load_chunk_bytes = load_chunk_bytes
        self.load_first_chunk_bytes = load_first_chunk_bytes
        self.load_depth = max(1, load_depth)
        self.load_direct_bytes = load_direct_bytes
        self._direct = DirectReader(self.tiers, self.metrics, writer.release)
        self._read_gates: dict[int, asyncio.Semaphore] = {}  # loop thread only

    # --- caller side ---------------------------------------------------------------------------
    def load_pipelined(self, layout: EngineLayout, block_ids: Sequence[int], keys: Sequence[BlockKey],
                        timeout: float | None, loaded: list[int], tiers_of: list[str], st: LoadStages,
                        pacer: Pacer | None = None, decode_threads: int | None = None) -> None:
        """Fill ``loaded``/``tiers_of`` with the restored prefix, ``st`` with the stage timings."""
        n = len(block_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        rb = record_bytes(layout.shape)
        per_chunk = min(self._writer.slab_bytes(layout) // rb, max(1, self.load_chunk_bytes // rb))
        src = {self._state.fastest(k) for k in keys}
        tier_chunk = self._tier_chunk_bytes(src)
        if tier_chunk is not None:  # a tier whose requests cost more than overlap gains: its size
            per_chunk = min(self._writer.slab_bytes(layout) // rb, max(1, tier_chunk // rb))
        only_ti = next(iter(src)) if len(src) == 1 else None
        direct_ti = only_ti if only_ti is not None and self.tiers[only_ti].slab_reads_now else None
        direct_max = min(self._writer.slab_bytes(layout), self.load_direct_bytes)
        if direct_ti is not None and per_chunk < n <= direct_max // rb:
            per_chunk = n
        # a small first chunk lets verify+scatter start while the rest is read; a load of at most
        # one chunk from a tier that reads on the caller: read there, in two parts when large
        # enough (``store.reads.direct``); else one chunk in as few requests as the tier allows
        if n > per_chunk:
            direct_ti = None
        first = first_part(n, rb) if direct_ti is not None else n if n <= per_chunk else \
            per_chunk if tier_chunk is not None else max(1, min(per_chunk, self.load_first_chunk_bytes // rb))
        in_place_ok = layout.fast_table() is not None
        budget, budget_binding = self._budget(layout, keys, deadline)
        stalled = False  # a tier gave up one of this load's reads for silence
        inflight: deque[ChunkRead] = deque()
        # compiled paths only (a CUDA layout's host verify too): Python's holds the GIL, threads take turns
        fans = in_place_ok or (layout.is_cuda and verify_is_compiled(layout))
        ways = (None if decode_threads is None else max(1, decode_threads)) if fans else 1
        decoder = _ChunkDecoder(pacer, deadline, rb, ways)
        session = RestoreSession(layout.device) if layout.is_cuda else None  # module docstring
        next_i = 0
        spans: dict[int, list[tuple[float, float]]] = {}
        nbytes: dict[int, int] = {}

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        after: concurrent.futures.Future | None = None  # the direct read of the previous part

        def start(wait: float | None) -> bool:
            nonlocal next_i, after
            if next_i == 0:
                end = min(n, first)
            else:  # the rest in equal chunks: no small tail chunk left queued behind the others
                left = n - next_i
                chunks = -(-left // per_chunk)
                end = next_i + -(-left // chunks)
            sources = {self._state.fastest(k) for k in keys[next_i:end]}
            # GPU-direct only when every block of the chunk is in a GPU-direct tier (else host staging)
            gd = sources if self._writer.device_fits(layout) and None not in sources else set()
            slab = self._writer.acquire(layout, gd, wait)  # type: ignore[arg-type]
            if slab is None:
                return False
            only = next(iter(sources)) if len(sources) == 1 else None
            if (only is not None and in_place_ok and not isinstance(slab, DeviceSlab)
                    and self.tiers[only].reads_in_place):
                inflight.append(ChunkRead(next_i, end, slab, None, Handoff(), in_place=only))
            elif only is not None and only == direct_ti and isinstance(slab, Slab):
                # with a deadline, read on a helper the caller stops waiting for at the deadline
                # (a stalled device must not hold the engine's thread); parts in sequence
                if next_i == 0 and deadline is None:
                    rd = self._direct.read_now(slab, rb, next_i, end, keys, only)
                else:
                    rd = self._direct.read_soon(slab, rb, next_i, end, keys, only, after)
                after = rd.fut
                inflight.append(rd)
            else:
                inflight.append(self._start_read(slab, rb, next_i, end, keys[next_i:end],
                                                 frugal=pacer is not None and pacer.limiting(), budget=budget))
            next_i = end
            return True

        try:
            while per_chunk > 0 and not self._state.closed:
                if not inflight and session is not None and next_i < n and not session.settle():
                    break  # (settled: the wait for a slab below must not wait on slabs this load holds)
                if not inflight and (next_i >= n or not start(remaining())):
                    break
                # read ahead into slabs free right now, leaving one for offloads; while the pacer
                # holds verify+scatter back, only the next chunk: the reads' CPU is spread out too
                depth = min(2, self.load_depth) if pacer is not None and pacer.limiting() else self.load_depth
                while (next_i < n and len(inflight) < depth and self.staging.free_count > 1
                       and start(0)):
                    pass
                rd = inflight.popleft()
                if deadline is not None and time.monotonic() >= deadline:
                    # in-place host chunks never wait on a read: without this a long host restore
                    # would outlive its timeout (and the quiesce that waits for it)
                    log.warning("load timed out after %.1fs with %d of %d blocks restored; recomputing the rest",
                                timeout, len(loaded), n)
                    self._abandon(rd)
                    break
                st.chunks += 1
                if rd.in_place is not None:
                    ok, want = self._decode_in_place(layout, rd, block_ids, keys, rb, loaded, tiers_of, st, decoder)
                    if ok < want:
                        break
                    if rd.start + want < rd.end:  # records left the host tier since the chunk was planned
                        inflight.appendleft(self._start_read(rd.slab, rb, rd.start + want, rd.end,
                                                             keys[rd.start + want:rd.end], budget=budget))
                    continue
                t0 = time.perf_counter()
                sources = self._finish_read(rd, remaining())
                st.wait_s += time.perf_counter() - t0
                if sources is None:  # timed out or failed; the slab is taken care of
                    break
                stalled = stalled or rd.stalled
                for ti, sp in rd.spans.items():
                    spans.setdefault(ti, []).extend(sp)
                for ti, b in rd.nbytes.items():
                    nbytes[ti] = nbytes.get(ti, 0) + b
                t0 = time.perf_counter()
                ok = self._decode_chunk(layout, rd, sources, block_ids, keys, rb, loaded, tiers_of, decoder, session)
                st.decode_s += time.perf_counter() - t0
                if ok < rd.end - rd.start:
                    break
        finally:
            while inflight:  # a failure stopped us: later chunks are not needed
                self._abandon(inflight.popleft())
            st.paced_s = decoder.waited_s
            st.decode_s -= decoder.waited_s
            t0 = time.perf_counter()
            if session is not None and not session.finish():  # then the blocks hold the records
                del loaded[:], tiers_of[:]  # the device failed: nothing restored can be trusted
            st.decode_s += time.perf_counter() - t0
        if len(loaded) < n:
            self._count_abandoned(budget, budget_binding, deadline, stalled)
        for ti, sp in spans.items():
            name = self.tiers[ti].name
            st.read_s[name] = st.read_s.get(name, 0.0) + union_length(sp)
        for ti, b in nbytes.items():
            name = self.tiers[ti].name
            st.read_bytes[name] = st.read_bytes.get(name, 0) + b

    def _decode_in_place(self, layout: EngineLayout, rd: ChunkRead, block_ids: Sequence[int],
                         keys: Sequence[BlockKey], rb: int, loaded: list[int], tiers_of: list[str],
                         st: LoadStages, decoder: _ChunkDecoder) -> tuple[int, int]:
        """Verify+scatter a host-tier chunk from the arena. Returns (restored, records found); records
        not found any more are left to a normal read of the rest of the chunk into ``rd.slab``."""
        ti = rd.in_place
        assert ti is not None and isinstance(rd.slab, Slab)
        tier = self.tiers[ti]
        slab = rd.slab
        t0 = time.perf_counter()
        views, pin = tier.pin_records(keys[rd.start:rd.end], lambda j: slab.array[j * rb:(j + 1) * rb])
        t1 = time.perf_counter()
        name = tier.name
        st.read_s[name] = st.read_s.get(name, 0.0) + (t1 - t0)
        want = next((j for j, v in enumerate(views) if v.nbytes != rb), len(views))  # foreign shape: a miss
        st.read_bytes[name] = st.read_bytes.get(name, 0) + want * rb
        self.metrics.read_seconds.labels(name).observe(t1 - t0)
        self.metrics.read_bytes.labels(name).inc(want * rb)
        promote: list[tuple[int, BlockKey, list[int]]] = []
        ok = 0
        try:
            ids, ks = block_ids[rd.start:rd.start + want], keys[rd.start:rd.start + want]
            try:
                ns = self._ns_digest
                errors = decoder(want, lambda a, b: decode_records(views[a:b], layout, ids[a:b], namespace=ns,
                                                                 keys=ks[a:b]))
            except Exception:  # a broken decode, not a bad record: fail the rest, keep serving
                log.exception("decoding a load chunk failed; its blocks will be recomputed")
                errors = None
            if errors is not None:
                ok = self._account(rd.start, [ti] * want, errors, block_ids, keys, loaded, tiers_of, promote)
                if promote and ok == want == rd.end - rd.start:  # the slab is free for the records to promote
                    for j, _, _ in promote:
                        np.copyto(slab.array[j * rb:(j + 1) * rb], views[j][:rb])
        finally:
            pin.release()
            st.decode_s += time.perf_counter() - t1
        if ok < want:
            self._writer.release(slab)
        elif want < rd.end - rd.start:
            pass  # records left the host tier since the chunk was planned: the caller reads them into the slab
        elif promote:
            self._state.schedule(self._writer.write_slab(slab, rb, promote))
        else:
            self._writer.release(slab)
        return ok, want

    def _decode_chunk(self, layout: EngineLayout, rd: ChunkRead, sources: list[int | None],
                      block_ids: Sequence[int], keys: Sequence[BlockKey], rb: int, loaded: list[int],
                      tiers_of: list[str], decoder: _ChunkDecoder, session: RestoreSession | None = None) -> int:
        """Verify+scatter one read chunk; hand its slab on (promotion) or free it. Returns #restored.
        ``session`` (CUDA layouts): the load's; the slab is handed on once its copies are done."""
        start, slab = rd.start, rd.slab
        # the slab's next holder may write it: not while a copy of this load still reads it
        later = session.after if session is not None else lambda fn: fn()
        n_read = next((j for j, src in enumerate(sources) if src is None), len(sources))
        # One batched verify+scatter of everything read; blocks after a failure are reported
        # failed whatever their own status (the engine recomputes from the first one).
        ids, ks = block_ids[start:start + n_read], keys[start:start + n_read]
        try:
            if not n_read:
                errors = []
            elif isinstance(slab, DeviceSlab):
                from ...blocks.device_codec import decode_blocks_on_device

                errors = decode_blocks_on_device(slab.tensor[:n_read * rb], layout, ids, namespace=self._ns_digest,
                                                 keys=ks, session=session)
            elif session is not None:  # CUDA: the host verify fans out, the chunk's one copy is queued here
                errors = decode_blocks(slab.array[:n_read * rb], layout, ids, namespace=self._ns_digest, keys=ks,
                                       session=session, spread=decoder)
            else:
                arr = slab.array
                errors = decoder(n_read, lambda a, b: decode_blocks(arr[a * rb:b * rb], layout, ids[a:b],
                                                                  namespace=self._ns_digest, keys=ks[a:b],
                                                                  session=session))
        except Exception:  # not a bad record but a broken decode (e.g. CUDA OOM): fail the rest, keep serving
            log.exception("decoding a load chunk failed; its blocks will be recomputed")
            later(lambda: self._writer.release(slab))
            return 0
        promote: list[tuple[int, BlockKey, list[int]]] = []
        ok = self._account(start, sources[:n_read], errors, block_ids, keys, loaded, tiers_of,
                           None if isinstance(slab, DeviceSlab) else promote)
        if promote:
            later(lambda: self._state.schedule(self._writer.write_slab(slab, rb, promote)))
        else:
            later(lambda: self._writer.release(slab))
        return ok

    def _account(self, start: int, sources: Sequence[int | None], errors: Sequence[Any],
                 block_ids: Sequence[int], keys: Sequence[BlockKey], loaded: list[int], tiers_of: list[str],
                 promote: list[tuple[int, BlockKey, list[int]]] | None) -> int:
        """Record hits up to the first failed record; collect promotions. Returns #restored."""
        ok = 0
        hits: dict[str, int] = {}
        tiers = self.tiers
        for j, e in enumerate(errors):
            src = sources[j]
            assert src is not None
            name = tiers[src].name
            k = keys[start + j]
            if e is not None:
                log.warning("block %s from tier %s failed verification (%s); recomputing", k.hex(), name, e)
                self.metrics.checksum_failures.labels(name).inc()
                self.metrics.misses.labels(name).inc()
                self._state.condemn(src, k)
                break
            hits[name] = hits.get(name, 0) + 1
            loaded.append(block_ids[start + j])
            tiers_of.append(name)
            ok += 1
            seen = self.admission.sight(k)
            targets = [ti for ti in range(self.write_depth)
                       if ti != src and not self._state.holds(ti, k) and self._writer.admits(ti, seen)]
            if targets and promote is not None:
                promote.append((j, k, targets))
        for name, c in hits.items():  # one metric update per chunk, not per block
            self.metrics.hits.labels(name).inc(c)
        return ok

    def _budget(self, layout: EngineLayout, keys: Sequence[BlockKey],
                deadline: float | None) -> tuple[ReadBudget | None, bool]:
        return restore_budget(self.recompute_tokens_per_s, self.tiers, self._state.fastest,
                              layout.shape.block_size, keys, deadline)

    def _count_abandoned(self, budget: ReadBudget | None, binding: bool, deadline: float | None,
                         stalled: bool = False) -> None:
        """Count a load cut short by time, once, by why (``dtkv_restores_abandoned_total``)."""
        reason = abandon_reason(budget, binding, deadline, stalled)
        if reason is not None:
            self.metrics.restores_abandoned.labels(reason).inc()

    # --- loop side -----------------------------------------------------------------------------
    def _start_read(self, slab: Slab | DeviceSlab, rb: int, start: int, end: int,
                    keys: Sequence[BlockKey], frugal: bool = False, budget: ReadBudget | None = None) -> ChunkRead:
        rd = ChunkRead(start, end, slab, None, Handoff(), frugal=frugal, budget=budget)
        rd.fut = asyncio.run_coroutine_threadsafe(self._read_into_slab(rd, rb, keys), self._state.loop)
        return rd

    def _finish_read(self, rd: ChunkRead, timeout: float | None) -> list[int | None] | None:
        """Each block's source tier (None from the first unreadable block on), or None on timeout
        or error (then the slab is freed: by the reader when the tier returns, or here)."""
        assert rd.fut is not None
        try:
            return rd.fut.result(timeout)
        except TimeoutError:
            with rd.hand.lock:
                if not rd.hand.done:
                    rd.hand.abandoned = True
                    log.warning("load of %d blocks timed out after %.1fs; recomputing", rd.end - rd.start, timeout)
                    return None
            try:
                return rd.fut.result()  # it finished just now
            except Exception:
                log.exception("load read failed")
                self._writer.release(rd.slab)
                return None
        except Exception:
            log.exception("load read failed")
            self._writer.release(rd.slab)  # the reader finished (with an error): it never frees the slab
            return None

    def _abandon(self, rd: ChunkRead) -> None:
        """Drop a read-ahead chunk nobody will consume; whoever finishes last frees the slab."""
        with rd.hand.lock:
            if rd.fut is not None and not rd.hand.done:
                rd.hand.abandoned = True
                return
        self._writer.release(rd.slab)  # the reader is past its I/O (or there is none) and never frees a slab

    async def _read_into_slab(self, rd: ChunkRead, rb: int, keys: Sequence[BlockKey]) -> list[int | None]:
        sources: list[int | None] = [None] * len(keys)
        try:
            # Runs of consecutive blocks whose fastest tier is the same, cut into concurrent pieces.
            pieces: list[tuple[int, int, int]] = []
            j = 0
            while j < len(keys):
                ti = self._state.fastest(keys[j])
                if ti is None:
                    self.metrics.misses.labels("none").inc()
                    break
                run_end = j + 1
                while run_end < len(keys) and self._state.fastest(keys[run_end]) == ti:
                    run_end += 1
                par, piece = self._read_shape(ti, rd.frugal)
                pieces.extend((ti, a, b) for a, b in _split(j, run_end, rb, par, piece))
                j = run_end
            # return_exceptions: every piece has finished (none can write into the slab) when we return
            got = await asyncio.gather(*(self._read_run(ti, rd, rb, keys, a, b) for ti, a, b in pieces),
                                       return_exceptions=True)
            for (ti, a, b), g in zip(pieces, got):
                g = g if isinstance(g, int) else 0
                for x in range(a, a + g):
                    sources[x] = ti
                if g < b - a:
                    break
            return sources
        finally:
            if rd.hand.finish():
                self._writer.release(rd.slab)

    def _tier_chunk_bytes(self, sources: set[int | None]) -> int | None:
        """The chunk size every tier in ``sources`` asks for (``load_chunk_bytes``: host memory's,
        the object tier's), the smallest if several; None when one asks none (None: no source)."""
        sizes = []
        for ti in sources:
            size = None if ti is None else self.tiers[ti].load_chunk_bytes
            if not size:
                return None
            sizes.append(int(size))
        return min(sizes) if sizes else None

    def _read_shape(self, ti: int, frugal: bool = False) -> tuple[int, int]:
        """(pieces a run is cut into at most, smallest piece in bytes) for tier ``ti``: the tier's
        ``read_parallelism`` / ``read_piece_bytes``, else its ``max_concurrency`` and MIN_PIECE_BYTES.
        ``frugal``: pieces of at least the tier's ``frugal_piece_bytes`` (fewer requests for the
        same bytes; the SSD tier's cost a third less CPU and arrive a little later)."""
        t = self.tiers[ti]
        par = t.read_parallelism or t.max_concurrency or 1
        piece = t.read_piece_bytes or MIN_PIECE_BYTES
        if frugal:
            piece = max(piece, t.frugal_piece_bytes or piece)
        return max(1, int(par)), max(1, int(piece))

    def _read_gate(self, ti: int) -> asyncio.Semaphore | None:  # loop thread only (its map too)
        """A tier with ``read_parallelism`` has at most that many reads in flight across all loads,
        started first come first served: a load's earlier pieces are not slowed down by its
        read-ahead sharing the device with them, so chunks arrive in order (a device shared fairly
        between four chunks finishes all four late, and the caller waits on the first)."""
        par = self.tiers[ti].read_parallelism
        if not par:
            return None
        gates = self._read_gates
        gate = gates.get(ti)
        if gate is None:
            gate = gates[ti] = asyncio.Semaphore(max(1, int(par)))
        return gate

    async def _read_run(self, ti: int, rd: ChunkRead, rb: int, keys: Sequence[BlockKey], start: int,
                        end: int) -> int:
        """Read keys[start:end] from tier ``ti`` into slab slots; return how many leading ones arrived."""
        tier = self.tiers[ti]
        slab = rd.slab
        if isinstance(slab, DeviceSlab) and not self._writer.gpu_direct(ti):
            self.metrics.misses.labels(tier.name).inc(end - start)
            return 0  # moved to a tier without GPU-direct (or the path failed) since the chunk started
        gate = self._read_gate(ti)
        if gate is not None:
            await gate.acquire()
        try:
            if rd.hand.abandoned:  # nobody waits for this chunk any more: no I/O into its slab
                return 0
            return await self._read_piece(tier, ti, rd, rb, keys, start, end)
        finally:
            if gate is not None:
                gate.release()

    async def _read_piece(self, tier: Tier, ti: int, rd: ChunkRead, rb: int, keys: Sequence[BlockKey],
                          start: int, end: int) -> int:
        slab = rd.slab
        t0 = time.perf_counter()
        try:
            with read_budget(rd.budget):  # bounds the tiers that can bound their I/O (the object tier)
                if isinstance(slab, Slab):  # no request or view per record where the tier has such a path
                    results = await tier.read_slab(keys[start:end], slab.array[start * rb:end * rb], rb)
                else:
                    results = await tier.read_many([ReadRequest(keys[j], slot_view(slab, j * rb, rb))
                                                    for j in range(start, end)])
        except Exception as e:
            rd.stalled = rd.stalled or stalled_read(e)
            self.metrics.errors.labels(tier.name, "read").inc()
            self.metrics.misses.labels(tier.name).inc(end - start)
            log.warning("read of %d blocks from tier %s failed: %s", end - start, tier.name, e)
            return 0
        t1 = time.perf_counter()
        self.metrics.read_seconds.labels(tier.name).observe(t1 - t0)
        got = 0
        for r in results:
            if r is None or r < rb:
                break
            got += 1
        rd.spans.setdefault(ti, []).append((t0, t1))
        rd.nbytes[ti] = rd.nbytes.get(ti, 0) + got * rb
        self.metrics.read_bytes.labels(tier.name).inc(got * rb)
        if got < end - start:
            self.metrics.misses.labels(tier.name).inc(end - start - got)
        return got


def _split(start: int, end: int, rb: int, parallelism: int, min_piece: int | None = None) -> list[tuple[int, int]]:
    """[start, end) in up to ``parallelism`` near-equal pieces of at least ``min_piece`` bytes
    (MIN_PIECE_BYTES by default)."""
    n = end - start
    k = max(1, min(parallelism, n, n * rb // (min_piece or MIN_PIECE_BYTES)))
    bounds = [start + n * i // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]
