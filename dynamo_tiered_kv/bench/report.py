"""Output helpers every ``dtkv bench`` shares: progress on stderr, plain-text tables on stdout.

The contract (``commands/bench.py``): ``run(args) -> dict`` is the result, printed as JSON with
``--json`` and nothing else on stdout; without it the module's ``format_result(result) -> str``
(tables built with :func:`table`) is printed, or :func:`key_values` when a bench has none.
Progress goes to stderr so ``--json > out.json`` stays parseable; ``--no-progress`` silences it.

Not a bench itself: ``commands/bench.py`` lists only modules that define ``run``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

_progress_on = True


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of ``xs``; NaN when empty."""
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def set_progress(enabled: bool) -> None:
    """Turn progress lines on or off for this process (``--no-progress``)."""
    global _progress_on
    _progress_on = enabled


def progress(bench: str, msg: str) -> None:
    """One progress line on stderr: ``[bench] msg``."""
    if _progress_on:
        print(f"[{bench}] {msg}", file=sys.stderr, flush=True)


class Steps:
    """Numbered progress for work of known length: ``[codec] 3/8 llama encode (4.2 s)``."""

    def __init__(self, bench: str, total: int) -> None:
        self.bench, self.total, self.done = bench, total, 0
        self._t0 = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        progress(self.bench, f"{self.done}/{self.total} {what} ({time.monotonic() - self._t0:.1f} s)")


def fmt(v: Any, spec: str = "") -> str:
    """A cell: ``-`` for None, yes/no for bools, floats by ``spec`` (default 3 significant digits)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec or (".3g" if abs(v) < 1000 else ".0f"))
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    return format(v, spec) if spec else str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None,
          fmts: Sequence[str] | None = None) -> str:
    """Columns sized to their widest cell; numbers right-aligned, text left-aligned."""
    fmts = list(fmts or [""] * len(headers))
    cells = [[fmt(v, fmts[i]) for i, v in enumerate(r)] for r in rows]
    numeric = [all((isinstance(r[i], (int, float)) and not isinstance(r[i], bool)) or r[i] is None for r in rows)
               for i in range(len(headers))]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)]
    return "\n".join(out)


def key_values(result: Mapping[str, Any], *, title: str | None = None) -> str:
    """Scalar fields as ``key  value`` lines (nested values are left to ``--json``)."""
    items = [(k, v) for k, v in result.items() if not isinstance(v, (dict, list))]
    width = max((len(k) for k, _ in items), default=0)
    out = [title] if title else []
    out += [f"{k:<{width}}  {fmt(v)}" for k, v in items]
    skipped = [k for k, v in result.items() if isinstance(v, (dict, list))]
    if skipped:
        out.append(f"({', '.join(skipped)}: see --json)")
    return "\n".join(out)
