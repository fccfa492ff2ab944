"""Restores of one chunk from one tier, read without the store's loop (``read_slab_now``).

A small restore (a 2k-token prefix: 15 MiB at 8 KiB/token) read as several chunks through the
loop spent more in hand-offs between threads than overlapping its reads with verify+scatter
saved, so it is read by a blocking ``read_slab_now`` on one helper thread (``dtkv-readnow``)
while the caller waits for it, at most until the load's deadline: a read on the caller's own
thread could not be abandoned, and a stalled device (a hung NVMe, a slow network disk) would
hold the caller (often the engine's thread) for as long as the I/O hangs. A load without a
deadline has nothing to bound and reads its first part on the calling thread (no hand-off).

Read whole, a chunk's verify+scatter (2.5-3.1 ms on one thread) only starts once the last byte
arrived (10-15 ms on a 2-vCPU Xeon VM's virtio disk). So a direct load of at least
``SPLIT_MIN_BYTES`` is read in two parts: the first ``FIRST_SHARE``, then the rest, read once the
first part's read returned (on the helper that read it: no second wake-up) while the caller
verifies+scatters the first part; the caller then waits for the rest and verifies+scatters it.
The wait grows by the smaller part's verify+scatter instead of all of it.

Whoever is last frees a part's slab: the caller once it consumed the part, or the helper when
its read returns after the caller stopped waiting (``Handoff``); a part the caller abandoned
before its read started reads nothing into its slab.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...blocks.keys import BlockKey
from ...staging.slabs import Slab
from ...tiers.base import Tier
from ..metrics import StoreMetrics
from .chunk import ChunkRead, Handoff
from .helper_pools import helper_pool

log = logging.getLogger("dynamo_tiered_kv.store")

#: a direct load at least this large is read in two parts (below, the hand-off costs about what
#: the overlap saves)
SPLIT_MIN_BYTES = 8 << 20
#: share of a split direct load read first: the rest must take at least as
#: long to read as the first part takes to verify+scatter (reading ran ~4x slower than
#: verify+scatter per byte on the Xeon VM), and the less is left the less is verified at the end
FIRST_SHARE = 0.75
#: helper threads that run direct reads: one per load reading at a time (the engine's thread, a
#: few restore threads); a load's two parts run one after the other on one of them
READ_THREADS = 4


def first_part(n: int, rb: int) -> int:
    """Records a direct load of ``n`` records of ``rb`` bytes reads first (before the rest)."""
    if n < 2 or n * rb < SPLIT_MIN_BYTES:
        return n
    return min(n - 1, max(1, round(n * FIRST_SHARE)))


class DirectReader:
    """Reads of one chunk through a tier's ``read_slab_now`` (module docstring), for the reader.

    ``release`` frees a slab (the writer's: host or device pool). Threads: ``read_now`` runs on the
    calling (loading) thread; ``read_soon`` hands the read to a ``dtkv-readnow`` helper thread;
    ``Handoff`` decides who frees each slab. Holds no state of its own besides its arguments.
    """

    def __init__(self, tiers: Sequence[Tier], metrics: StoreMetrics, release: Callable[[Any], None]) -> None:
        self.tiers = tiers
        self.metrics = metrics
        self._release = release

    def read_now(self, slab: Slab, rb: int, start: int, end: int, keys: Sequence[BlockKey], ti: int) -> ChunkRead:
        """Records ``start:end`` of a load without a deadline, read on the calling thread: no
        hand-off to another thread and back, each a wake-up that comes late on a busy CPU."""
        rd = ChunkRead(start, end, slab, None, Handoff())
        rd.fut = concurrent.futures.Future()
        rd.fut.set_result(self.read_direct(rd, rb, keys, ti))
        rd.hand.done = True  # nothing reads into the slab any more
        return rd

    def read_soon(self, slab: Slab, rb: int, start: int, end: int, keys: Sequence[BlockKey], ti: int,
                   after: concurrent.futures.Future | None = None) -> ChunkRead:
        """Records ``start:end`` read on a helper thread; the caller waits for ``fut`` (bounded by
        its deadline, ``_finish_read``). With ``after`` (the previous part's read), the read starts
        once that one returned, on the thread that read it: the parts of one load never share the
        device, so the first arrives as early as read alone. If the caller stops waiting, the
        helper frees the slab when its read returns (or at once, without reading, when the caller
        gave up before the read started)."""
        rd = ChunkRead(start, end, slab, None, Handoff())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        rd.fut = fut
        n = end - start

        def read() -> None:
            try:
                # nobody waits for this part any more (an earlier one timed out): no I/O into its slab
                got = [None] * n if rd.hand.abandoned else self.read_direct(rd, rb, keys, ti)
            except BaseException as e:  # _read_direct catches tier errors: this is a bug, report it
                if rd.hand.finish():
                    self._release(rd.slab)
                fut.set_exception(e)
                return
            # past the I/O before the result is out: a caller that timed out just now sees ``done``
            # and takes the result (``_finish_read``), else the slab is ours to free
            if rd.hand.finish():
                self._release(rd.slab)
            fut.set_result(got)

        pool = helper_pool("dtkv-readnow", READ_THREADS)
        caller = threading.current_thread()

        def follow(_: concurrent.futures.Future) -> None:
            # on the helper that completed ``after``: the read follows at once; on the caller when
            # ``after`` completed just before this was added: a helper reads, never the caller
            if threading.current_thread() is caller:
                pool.submit(read)
            else:
                read()

        if after is None or after.done():
            pool.submit(read)
        else:
            after.add_done_callback(follow)
        return rd

    def read_direct(self, rd: ChunkRead, rb: int, keys: Sequence[BlockKey], ti: int) -> list[int | None]:
        """Read ``rd``'s records from tier ``ti`` into its slab; each record's source (None from the
        first one missing on). Fills ``rd.spans``/``rd.nbytes`` and the read metrics."""
        tier = self.tiers[ti]
        n = rd.end - rd.start
        t0 = time.perf_counter()
        try:  # None: the tier has no such path (the reader only sends tiers with ``slab_reads_now``)
            results = tier.read_slab_now(keys[rd.start:rd.end], rd.slab.array[:n * rb], rb) or []
        except Exception as e:
            self.metrics.errors.labels(tier.name, "read").inc()
            log.warning("read of %d blocks from tier %s failed: %s", n, tier.name, e)
            results = []
        t1 = time.perf_counter()
        got = next((j for j, r in enumerate(results) if r is None or r < rb), len(results))
        self.metrics.read_seconds.labels(tier.name).observe(t1 - t0)
        self.metrics.read_bytes.labels(tier.name).inc(got * rb)
        if got < n:
            self.metrics.misses.labels(tier.name).inc(n - got)
        rd.spans[ti] = [(t0, t1)]
        rd.nbytes[ti] = got * rb
        return [ti] * got + [None] * (n - got)
