"""Where one restore spent its time: filled by the read path, observed by metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadStages:
    """Where one ``load`` spent its time (seconds) and what each tier delivered.

    ``read_s[tier]``: wall time the tier was reading for this load (the union of its read intervals,
    so chunks read in parallel count once); for in-place host reads, the time to pin the records.
    ``read_bytes[tier]``: record bytes that arrived from the tier. ``wait_s``: time the calling
    thread was blocked on reads (what overlapping did not hide). ``decode_s``: verify+scatter on
    the calling thread, not counting ``paced_s``: time verify+scatter slices waited for the
    caller's pacer. ``total_s``: the whole call. Lookup is the caller's and not included.
    """

    read_s: dict[str, float] = field(default_factory=dict)
    read_bytes: dict[str, int] = field(default_factory=dict)
    wait_s: float = 0.0
    decode_s: float = 0.0
    paced_s: float = 0.0
    total_s: float = 0.0
    chunks: int = 0


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(spans):
        if cur_b is None or a > cur_b:
            if cur_b is not None and cur_a is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None and cur_a is not None:
        total += cur_b - cur_a
    return total
