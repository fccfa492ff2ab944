"""A busy neighbour: CPU-bound processes beside a benchmark, to measure a data path when the
machine's cores are not all its own (as on a shared inference host)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: a pure-Python spin: one core's worth of CPU demand, no memory or I/O traffic of its own
_SPIN = "while True:\n    pass\n"


@contextmanager
def busy_neighbours(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run ``count`` CPU-bound processes for the duration of the block; they are killed on exit,
    also when the block raises."""
    if count < 0:
        raise ValueError(f"busy neighbours must be >= 0, got {count}")
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
