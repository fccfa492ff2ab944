"""Fixed cost of one SSD restore read: a NIXL POSIX transfer against a blocking O_DIRECT ``preadv``.

``python -m dynamo_tiered_kv.bench.restore.reads DIR [--rounds 5]``: both paths read the same
ranges of one 64 MiB file in ``DIR`` (dropped from the page cache before every read), in
``--rounds`` alternating rounds, at the shapes of a restore: one 1 MiB read (a 128-token block of
8 KiB/token), one 2 MiB read, and 15 MiB (a 2k-token prefix) as 2 MiB reads from 8 and 16
threads. Prints the median and best per path and shape (ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...tiers.ssd.io import NixlIO, PosixIO, aligned_buffer

FILE_BYTES = 64 << 20
SHAPES = [(1 << 20, 1 << 20, 1), (2 << 20, 2 << 20, 1), (15 << 20, 2 << 20, 8), (15 << 20, 2 << 20, 16)]


def _timed(io: PosixIO, path: Path, buf, total: int, piece: int, depth: int) -> float:
    fd = io.open(path)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        parts = [(o, min(piece, total - o)) for o in range(0, total, piece)]
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(lambda _: None, range(depth)))  # threads started outside the timing
            t = time.perf_counter()
            list(pool.map(lambda p: io.read(fd, [buf[p[0]:p[0] + p[1]]], (8 << 20) + p[0]), parts))
            return time.perf_counter() - t
    finally:
        io.close_fd(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "restore-reads.bin"
    if not path.exists() or path.stat().st_size != FILE_BYTES:
        path.write_bytes(os.urandom(FILE_BYTES))
    nixl = NixlIO()
    nixl.nixl_reads = True
    paths = {"nixl": nixl, "preadv": PosixIO(direct=True)}
    buf = aligned_buffer(16 << 20)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    for total, piece, depth in SHAPES:
        ms: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(args.rounds):
            for name, io in paths.items():
                ms[name].append(_timed(io, path, buf, total, piece, depth) * 1000)
        print(f"{total >> 20:>3} MiB as {piece >> 20} MiB reads x {depth:>2} threads: " + "; ".join(
            f"{k} median {statistics.median(v):.1f} best {min(v):.1f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
