"""How fast one backend's recent ranged GETs answered: first-byte latency and throughput.

The window feeds two decisions: when a read sends a second, hedged GET (``hedge.py``: after the
p99 first-byte latency), and whether a restore can arrive within its budget at all
(``ObjectTier.read_many``: median first byte + bytes / throughput). A GET whose first byte never
came is recorded at the bound it was given up at (a censored sample): a stalled gateway raises
the estimates, so hedges stop doubling requests that cannot be answered and restores that
cannot make their budget stop being sent.
"""

from __future__ import annotations

from collections import deque

WINDOW = 256  # GETs remembered
MIN_SAMPLES = 8  # fewer: no estimate (no hedging, no early miss)
MIN_RATE_BYTES = 256 << 10  # smaller bodies measure latency, not throughput


class GetLatency:
    """The last ``window`` GETs of one backend.

    Threads: the backend's event loop only (its GETs record here; the tier reads the estimates
    on the same loop).
    """

    def __init__(self, window: int = WINDOW) -> None:
        self._first: deque[float] = deque(maxlen=window)  # seconds from the attempt's start
        self._xfer: deque[tuple[int, float]] = deque(maxlen=window)  # (body bytes, seconds after the first byte)
        self._sorted: list[float] | None = None  # ``_first`` sorted, rebuilt on demand

    def __len__(self) -> int:
        return len(self._first)

    def first_byte(self, seconds: float) -> None:
        """A GET's first response byte arrived ``seconds`` after it started (or it was given up
        then, without one)."""
        self._first.append(max(0.0, seconds))
        self._sorted = None

    def transfer(self, nbytes: int, seconds: float) -> None:
        """A GET's body of ``nbytes`` arrived within ``seconds`` of its first byte."""
        if nbytes >= MIN_RATE_BYTES and seconds > 0:
            self._xfer.append((nbytes, seconds))

    def quantile(self, q: float) -> float | None:
        """First-byte latency at quantile ``q`` (0..1) of the window; None below ``MIN_SAMPLES``."""
        if len(self._first) < MIN_SAMPLES:
            return None
        if self._sorted is None:
            self._sorted = sorted(self._first)
        s = self._sorted
        return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]

    def bytes_per_s(self) -> float | None:
        """Body throughput of one GET over the window (large bodies only); None if none seen."""
        if not self._xfer:
            return None
        return sum(n for n, _ in self._xfer) / sum(s for _, s in self._xfer)

    def expected_s(self, nbytes: int) -> float | None:
        """Expected time of one GET of ``nbytes``: the median first byte plus the body at the
        window's throughput (the first byte alone while no throughput is known: a lower bound).
        None while the window holds fewer than ``MIN_SAMPLES`` GETs."""
        first = self.quantile(0.5)
        if first is None:
            return None
        rate = self.bytes_per_s()
        return first + (nbytes / rate if rate else 0.0)
