"""How large one ranged GET of a restore is: sized from how the bucket has been answering.

A GET of ``B`` bytes costs its first-byte latency ``L`` (request, queueing, on HDD-backed
buckets a seek) plus ``B / R``, ``R`` being one GET's body throughput. The latency is paid once per
GET whatever its size, so a piece should be large enough that ``L`` is a small share of it:
``B >= k * L * R`` keeps ``L / (L + B / R) <= 1 / (1 + k)`` (``k = 9``: at least 90% of a GET is
transfer). It should be no larger than that: smaller pieces spread one restore over more
connections at once (each one's ``R`` adds up to more than one connection gives), and a slow
GET holds back less of the restore.

``L`` is the median first byte of the backend's recent GETs and ``R`` their body throughput
(``latency.GetLatency``). Without enough of them (a fresh process, a backend that keeps no
window) the piece is the largest: fewer, larger requests are the safe guess on a bucket whose
disks seek per request, and the window fills within the first restores. Bounds: at least
``MIN_PIECE_BYTES`` (below it a request's fixed costs on the client and the gateway dominate
even on a fast network), at most ``MAX_PIECE_BYTES`` (a staging slab's worth: a restore's chunk
is not read in larger requests anyway), in whole MiB.

``piece_bytes`` is a pure function of numbers; ``window_piece_bytes`` applies it to a window.
No I/O, no state, any thread.
"""

from __future__ import annotations

import math

from .latency import GetLatency

MiB = 1 << 20
MIN_PIECE_BYTES = 8 * MiB
MAX_PIECE_BYTES = 64 * MiB
#: transfer time per first-byte time of one GET: its latency is at most 1 / (1 + k) of it
LATENCY_SHARE_K = 9.0


def piece_bytes(first_byte_s: float | None, bytes_per_s: float | None, *, k: float = LATENCY_SHARE_K,
                min_bytes: int = MIN_PIECE_BYTES, max_bytes: int = MAX_PIECE_BYTES) -> int:
    """Bytes of one ranged GET: ``k * first_byte_s * bytes_per_s`` rounded up to whole MiB and held
    within ``[min_bytes, max_bytes]``; ``max_bytes`` when either estimate is unknown (None, not
    finite, throughput not positive) or the latency is negative.

    Raises:
        ValueError: ``k`` not positive, or bounds that are not whole MiB with
            ``0 < min_bytes <= max_bytes``.
    """
    if not k > 0:
        raise ValueError(f"k must be positive, got {k}")
    if not (0 < min_bytes <= max_bytes) or min_bytes % MiB or max_bytes % MiB:
        raise ValueError(f"piece bounds must be whole MiB with 0 < min <= max, got [{min_bytes}, {max_bytes}]")
    if first_byte_s is None or bytes_per_s is None:
        return max_bytes
    if not (math.isfinite(first_byte_s) and math.isfinite(bytes_per_s)) or first_byte_s < 0 or bytes_per_s <= 0:
        return max_bytes
    want = k * first_byte_s * bytes_per_s
    if want >= max_bytes:  # also keeps a huge product out of the integer conversion below
        return max_bytes
    return max(min_bytes, math.ceil(want / MiB) * MiB)


def window_piece_bytes(window: GetLatency | None) -> int:
    """``piece_bytes`` of a backend's GET window (median first byte, body throughput);
    ``MAX_PIECE_BYTES`` without a window (a backend that keeps none, e.g. a local directory).

    Threads: any. The window is written on the backend's loop; a read from another thread that
    meets a write in progress gets ``MAX_PIECE_BYTES`` for that once (the safe size) rather than
    an error.
    """
    if window is None:
        return MAX_PIECE_BYTES
    try:
        first, rate = window.quantile(0.5), window.bytes_per_s()
    except RuntimeError:  # "deque mutated during iteration": a GET recorded meanwhile
        return MAX_PIECE_BYTES
    return piece_bytes(first, rate)
