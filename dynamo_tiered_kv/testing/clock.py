"""A settable clock for retention and expiry tests (``RetentionClasses``, ``TieredStore`` take one)."""

from __future__ import annotations

import time


class ManualClock:
    """Returns ``t`` until a test moves it; starts at ``t`` (default: the wall clock, which tiers
    with a TTL compare object ages with)."""

    def __init__(self, t: float | None = None) -> None:
        self.t = time.time() if t is None else t

    def __call__(self) -> float:
        return self.t
