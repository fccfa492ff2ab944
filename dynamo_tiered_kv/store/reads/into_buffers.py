"""``TieredStore.load_into``: restores whose records' payloads are read straight into the caller's
buffers, one buffer per block, and verified there: no staging slab, no scatter copy.

For callers whose block IS one contiguous byte buffer equal to a record's canonical payload (an
engine that keeps each block as one opaque row: the payload is that row's bytes as-is). Each
record is read with its header into a scratch, its payload into the caller's buffer and its
padding into a scratch (``Tier.read_split_now``), then its header (identity: namespace, key,
shape; not sealed) and every layer's checksum are verified where the payload lies.

Contract (the caller's buffers are the caller's memory, not a slab the store owns):

* A record that is absent, unreadable or fails verification fails its block and every block
  after it (the caller recomputes from the first failure); a failed block's buffer holds
  unspecified bytes and must not be used. A record that failed verification is condemned
  (deleted from its tier, ``dtkv_checksum_failures_total``), as in ``load``.
* Only tiers that read into caller buffers serve here: ``split_reads_now`` (the SSD: blocking
  reads on helper threads) or ``split_reads`` (the object tier: ``read_split`` on the store's
  loop, one ranged GET per run of records, its body received straight into the buffers).
  ``planned`` is how many leading blocks such tiers hold; the caller loads the rest (if
  ``restored == planned``) through ``load``.
* Pieces of ``PIECE_BYTES`` (or the tier's ``read_piece_bytes``, if larger) are read and verified
  on helper threads, several at once (the device's queue stays busy while earlier pieces are
  verified). At the deadline the load stops: pieces not yet started never read; a read on the
  loop is cancelled (it returns once nothing writes any more); a blocking read already in flight
  lands in the caller's buffers, so this call waits for it before it returns (a stalled device
  holds the call as long as its read hangs; ``load``, which reads into slabs it can abandon,
  bounds that: ``IntoResult.waited_past_deadline``). Once it returns, nothing writes into the
  caller's buffers for this call any more.
* Object-tier reads run under the same restore budget as ``load`` (``budget.py``): with the
  engine's prefill rate known, no longer than recomputing would take, and not at all when the
  tier expects its GETs to take longer.
* No promotion into faster tiers: the records were never in a slab the writer could take.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import mmap
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..._native import fast
from ...blocks.codec import decode_header, header_bytes, record_bytes
from ...blocks.keys import BlockKey
from ...blocks.layout import BlockShape
from ...errors import (
    ChecksumMismatch,
    KeyMismatch,
    LayoutMismatch,
    NamespaceMismatch,
    RecordError,
    RecordSealed,
    TierUnavailable,
    stalled_read,
)
from ...tiers.base import ReadBudget, Tier, read_budget
from ..state import StoreState
from .budget import abandon_reason, restore_budget
from .helper_pools import helper_pool
from .stages import LoadStages

log = logging.getLogger("dynamo_tiered_kv.store")

#: bytes one piece reads (one request per run of records back to back in a segment) and verifies
PIECE_BYTES = 8 << 20
#: pieces of one load read at once (at least: a tier that reads on the loop may take its
#: ``max_concurrency``, its requests in flight)
PIECES_IN_FLIGHT = 4
#: helper threads shared by all such loads of the process
HELPER_THREADS = 8
#: how often a helper waiting for a read on the store's loop checks that the loop still runs
LOOP_CHECK_S = 0.5


@dataclass
class IntoResult:
    """``restored``: leading blocks verified in their buffers. ``planned``: leading blocks whose
    fastest tier reads into caller buffers (``restored < planned``: a failure or the deadline
    stopped the load there). ``tier_per_block``: the source tier of each restored block."""

    restored: int = 0
    planned: int = 0
    tier_per_block: list[str] = field(default_factory=list)
    stages: LoadStages = field(default_factory=LoadStages)
    #: the deadline passed with a read in flight, which the call then waited for
    waited_past_deadline: bool = False


class _Piece:
    """Blocks ``start:end`` from tier ``ti``, read and verified on a helper thread. ``outcome[j]``:
    None = verified; else why block ``start + j`` failed (the rest of the piece is not looked at)."""

    __slots__ = ("end", "fut", "loop_read", "nbytes", "read_s", "stalled", "start", "ti", "verify_s")

    def __init__(self, start: int, end: int, ti: int) -> None:
        self.start, self.end, self.ti = start, end, ti
        self.fut: concurrent.futures.Future[list[str | RecordError | None]] | None = None
        self.read_s = self.verify_s = 0.0
        self.nbytes = 0
        #: the piece's read on the store's loop, while it runs (None: a blocking read, or none yet)
        self.loop_read: LoopRead | None = None
        #: the read failed because its source stayed silent (``errors.stalled_read``)
        self.stalled = False


class LoopRead:
    """A coroutine run on the store's loop that another thread waits for and may cancel. ``wait``
    returns once it has stopped: a cancelled read has finished its cancellation, so nothing it
    started writes any more (``Tier.read_split``). Threads: created and waited for on a helper,
    cancelled from any thread; its task lives on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[object, object, list[int | None]]) -> None:
        self._loop = loop
        self._done = threading.Event()
        self._task: asyncio.Task[list[int | None]] | None = None
        self._cancelled = False  # loop thread only
        self.result: list[int | None] | None = None
        self.error: BaseException | None = None
        try:
            loop.call_soon_threadsafe(self._start, coro)
        except RuntimeError as e:  # the store's loop is closed: nothing was started
            coro.close()
            self.error = e
            self._done.set()

    def _start(self, coro: Coroutine[object, object, list[int | None]]) -> None:
        self._task = self._loop.create_task(coro)
        self._task.add_done_callback(self._finished)  # also when cancelled before its first step
        if self._cancelled:
            self._task.cancel()

    def _finished(self, task: asyncio.Task[list[int | None]]) -> None:
        if not task.cancelled():
            self.error = task.exception()
            if self.error is None:
                self.result = task.result()
        self._done.set()

    def cancel(self) -> None:
        def cancel_on_loop() -> None:
            self._cancelled = True
            if self._task is not None:
                self._task.cancel()
        with contextlib.suppress(RuntimeError):  # the loop is closed: its tasks no longer run
            self._loop.call_soon_threadsafe(cancel_on_loop)

    def wait(self) -> list[int | None] | None:
        """The read's result once it stopped (None: cancelled); raises what the read raised, or
        ``TierUnavailable`` if the loop stopped first (the store closed: a stopped loop receives
        nothing more, so nothing writes into the buffers any more either)."""
        while not self._done.wait(LOOP_CHECK_S):
            if not self._loop.is_running():
                raise TierUnavailable("the store's loop stopped during a read into the caller's buffers")
        if self.error is not None:
            raise self.error
        return self.result


class BufferLoader:
    """The ``load_into`` path (module docstring) over the store's shared state.

    Threads: ``load_into`` on any caller thread but the store's loop; reads and verification on
    ``dtkv-intobuf`` helpers. Holds only scratch buffers of its own (a free list: append/pop are
    atomic).
    """

    def __init__(self, state: StoreState, ns_digest: bytes,
                 recompute_rate: Callable[[], float | None] = lambda: None) -> None:
        self._state = state
        self.metrics = state.metrics
        self._ns = ns_digest
        #: the engine's prefill rate (tokens/s) now, which bounds object-tier reads (``budget.py``)
        self._recompute_rate = recompute_rate
        self._scratch: dict[int, list[np.ndarray]] = {}

    def load_into(self, shape: BlockShape, dests: Sequence[np.ndarray], keys: Sequence[BlockKey],
                  timeout: float | None) -> IntoResult:
        if len(dests) != len(keys):
            raise ValueError("dests and keys must have the same length")
        pb = shape.payload_bytes
        for d in dests:
            if (d.dtype != np.uint8 or d.ndim != 1 or d.nbytes != pb or not d.flags.c_contiguous
                    or not d.flags.writeable):
                raise ValueError(f"every destination must be a writable contiguous uint8 buffer of {pb} bytes")
        t0 = time.perf_counter()
        res = IntoResult()
        deadline = None if timeout is None else time.monotonic() + timeout
        pieces, in_flight = self._plan(shape, keys)
        res.planned = pieces[-1].end if pieces else 0
        budget, binding = restore_budget(self._recompute_rate(), self._state.tiers, self._state.fastest,
                                         shape.block_size, keys, deadline)
        stop = threading.Event()
        pool = helper_pool("dtkv-intobuf", HELPER_THREADS)
        started = 0

        def submit_more() -> None:
            nonlocal started
            while started < len(pieces) and started - done < in_flight:
                p = pieces[started]
                p.fut = pool.submit(self._run_piece, p, shape, dests, keys, stop, budget)
                started += 1

        done = 0
        late = False
        try:
            submit_more()
            while done < len(pieces):
                p = pieces[done]
                assert p.fut is not None
                w0 = time.perf_counter()
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    outcome = p.fut.result(left)
                except concurrent.futures.TimeoutError:
                    late = True
                    break
                except Exception:  # a bug, not a bad record: fail the rest, keep serving
                    log.exception("reading a load piece into the caller's buffers failed")
                    break
                finally:
                    res.stages.wait_s += time.perf_counter() - w0
                done += 1
                ok = next((j for j, o in enumerate(outcome) if o is not None), len(outcome))
                self._account(p, outcome, ok, keys, res)
                if ok < p.end - p.start:
                    break
                submit_more()
        finally:
            stop.set()  # pieces not started yet read nothing; reads on the loop see it and stop
            for p in pieces[done:started]:
                if p.loop_read is not None:
                    p.loop_read.cancel()
            for p in pieces[done:started]:  # a read in flight writes into the caller's buffers: wait for it
                assert p.fut is not None
                if not p.fut.done() and not self._state.tiers[p.ti].split_reads:
                    res.waited_past_deadline = res.waited_past_deadline or late
                concurrent.futures.wait([p.fut])
        if late:
            log.warning("load into caller buffers timed out after %.1fs with %d of %d blocks restored",
                        timeout, res.restored, len(keys))
        if res.restored < res.planned:
            reason = "deadline" if late else abandon_reason(budget, binding, deadline,
                                                            any(p.stalled for p in pieces[:done]))
            if reason is not None:
                self.metrics.restores_abandoned.labels(reason).inc()
        if res.restored < len(keys) and res.restored < res.planned:
            self.metrics.load_failed_blocks.inc(len(keys) - res.restored)
        res.stages.total_s = time.perf_counter() - t0
        res.stages.chunks = done
        if keys:
            self.metrics.observe_restore(res.stages)
        return res

    # --- planning and accounting (caller thread) -------------------------------------------------
    def _plan(self, shape: BlockShape, keys: Sequence[BlockKey]) -> tuple[list[_Piece], int]:
        """Pieces over the leading keys whose fastest tier reads into caller buffers, and how many
        to keep in flight."""
        tiers, fastest = self._state.tiers, self._state.fastest
        rb = record_bytes(shape)
        pieces: list[_Piece] = []
        in_flight = PIECES_IN_FLIGHT
        run_ti, run_start = None, 0
        for j, k in enumerate([*keys, None]):
            ti = fastest(k) if k is not None else None
            if ti is not None and not (tiers[ti].split_reads_now or tiers[ti].split_reads):
                ti = None
            if ti != run_ti or k is None:
                if run_ti is not None:
                    per_piece = max(1, _piece_bytes(tiers[run_ti]) // rb)
                    pieces += [_Piece(a, min(j, a + per_piece), run_ti) for a in range(run_start, j, per_piece)]
                    if tiers[run_ti].split_reads:
                        in_flight = max(in_flight, tiers[run_ti].max_concurrency)
                if ti is None:
                    break
                run_ti, run_start = ti, j
        return pieces, in_flight

    def _account(self, p: _Piece, outcome: list[str | RecordError | None], ok: int, keys: Sequence[BlockKey],
                 res: IntoResult) -> None:
        name = self._state.tiers[p.ti].name
        m = self.metrics
        res.restored += ok
        res.tier_per_block += [name] * ok
        res.stages.read_s[name] = res.stages.read_s.get(name, 0.0) + p.read_s
        res.stages.read_bytes[name] = res.stages.read_bytes.get(name, 0) + p.nbytes
        res.stages.decode_s += p.verify_s
        m.read_seconds.labels(name).observe(p.read_s)
        m.read_bytes.labels(name).inc(p.nbytes)
        if ok:
            m.hits.labels(name).inc(ok)
        if ok < len(outcome):
            bad = outcome[ok]
            k = keys[p.start + ok]
            m.misses.labels(name).inc()
            if isinstance(bad, RecordError):
                log.warning("block %s from tier %s failed verification (%s); recomputing", k.hex(), name, bad)
                m.checksum_failures.labels(name).inc()
                self._state.condemn(p.ti, k)

    # --- helper threads --------------------------------------------------------------------------
    def _run_piece(self, p: _Piece, shape: BlockShape, dests: Sequence[np.ndarray], keys: Sequence[BlockKey],
                   stop: threading.Event, budget: ReadBudget | None) -> list[str | RecordError | None]:
        n = p.end - p.start
        if stop.is_set():  # the caller gave up before this piece started: no I/O into its buffers
            return ["abandoned"] * n
        hb, pb = header_bytes(shape.num_layers), shape.payload_bytes
        rb = record_bytes(shape)
        pad = rb - hb - pb
        per = hb + pad
        scratch = self._take_scratch(n * per)
        try:
            parts = []
            for j in range(n):
                own = [scratch[j * hb:(j + 1) * hb], dests[p.start + j]]
                if pad:
                    own.append(scratch[n * hb + j * pad:n * hb + (j + 1) * pad])
                parts.append(own)
            t0 = time.perf_counter()
            tier = self._state.tiers[p.ti]
            try:
                if tier.split_reads:
                    got = self._read_on_loop(p, tier, keys[p.start:p.end], parts, rb, stop, budget) or [None] * n
                else:
                    got = tier.read_split_now(keys[p.start:p.end], parts, rb) or [None] * n
            except Exception as e:
                self.metrics.errors.labels(tier.name, "read").inc()
                log.warning("read of %d blocks from tier %s failed: %s", n, tier.name, e)
                p.stalled = stalled_read(e)
                got = [None] * n
            t1 = time.perf_counter()
            p.read_s = t1 - t0
            out: list[str | RecordError | None] = []
            for j in range(n):
                if got[j] != rb:
                    out += ["missing"] * (n - j)
                    break
                p.nbytes += rb
                err = verify_in_place(parts[j][0], parts[j][1], self._ns, keys[p.start + j], shape)
                out.append(err)
                if err is not None:
                    out += ["after a failure"] * (n - j - 1)
                    break
            p.verify_s = time.perf_counter() - t1
            return out
        finally:
            self._scratch.setdefault(scratch.nbytes, []).append(scratch)

    def _read_on_loop(self, p: _Piece, tier: Tier, keys: Sequence[BlockKey], parts: list[list[np.ndarray]],
                      rb: int, stop: threading.Event, budget: ReadBudget | None) -> list[int | None] | None:
        """``tier.read_split`` on the store's loop under the load's budget; cancelled if the load
        stops (``stop``) while it runs. None: cancelled."""
        async def read() -> list[int | None]:
            with read_budget(budget):
                return await tier.read_split(keys, parts, rb)

        p.loop_read = lr = LoopRead(self._state.loop, read())
        if stop.is_set():  # the load stopped between this piece's start and now: its cancel missed it
            lr.cancel()
        try:
            return lr.wait()
        finally:
            p.loop_read = None

    def _take_scratch(self, nbytes: int) -> np.ndarray:
        try:
            return self._scratch.get(nbytes, []).pop()
        except IndexError:  # page-aligned (direct I/O) and faulted in once, here, not on the read
            a = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
            a[::mmap.PAGESIZE] = 0
            return a


def _piece_bytes(tier: Tier) -> int:
    """Bytes one piece of ``tier`` reads: ``PIECE_BYTES``, or the tier's own read size if larger
    (the object tier: one ranged GET per piece, sized for its bucket)."""
    return max(PIECE_BYTES, tier.read_piece_bytes or 0)


def _xxh3(buf: np.ndarray) -> int:
    return fast.xxh3_64(buf) if fast.AVAILABLE else xxhash.xxh3_64_intdigest(buf)


def verify_in_place(header: np.ndarray, payload: np.ndarray, namespace: bytes, key: BlockKey,
                    shape: BlockShape) -> RecordError | None:
    """Why a record whose header lies in ``header`` and whose payload lies in ``payload`` must not
    be served (None: it may): the header's own checksum and lengths, its identity (namespace,
    key, shape), not sealed, and every layer's checksum over ``payload``."""
    try:
        hdr = decode_header(header)
        if hdr.namespace != namespace:
            raise NamespaceMismatch("record belongs to another namespace (model, layout or tenant)")
        if hdr.key != key:
            raise KeyMismatch(f"record key {hdr.key.hex()} != expected {bytes(key).hex()}")
        if hdr.shape != shape:
            raise LayoutMismatch(f"record shape {hdr.shape} does not fit engine shape {shape}")
        if hdr.sealed:
            raise RecordSealed(f"record {bytes(key).hex()} is sealed for its tenant; this reader has not opened it")
        lb = shape.layer_bytes
        for j, want in enumerate(hdr.layer_sums):
            if _xxh3(payload[j * lb:(j + 1) * lb]) != want:
                raise ChecksumMismatch(f"layer {j} payload checksum mismatch (key {bytes(key).hex()})")
    except RecordError as e:
        return e
    return None
