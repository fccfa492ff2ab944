"""The S3 server's own read ceiling, measured beside the tiers in ``bench tiering``.

The same bytes a run loads (one object per prefix, uploaded once, not timed) are read with plain
parallel ranged GETs by a C client (``curl --parallel``), bodies discarded: no tier, no
checksum, no copy into a primary region. Each run tries a few request shapes and keeps the
fastest, so the row is the best a client found on this server in that minute. A tier's load
over it says how much of the server it uses; ``raw / obj`` bounds how far any client could beat
vLLM's ``obj`` tier on the same server.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
import time
from typing import Any

MiB = 1 << 20
#: (bytes per GET or 0 for whole objects, GETs in flight)
SHAPES = ((0, 8), (8 * MiB, 16), (16 * MiB, 32))


def available() -> bool:
    return shutil.which("curl") is not None


def upload(s3: Any, bucket: str, prefix: str, objects: int, size: int) -> list[str]:
    """``objects`` objects of ``size`` random bytes under ``prefix``; their keys."""
    body = os.urandom(size)
    keys = [f"{prefix}/raw-{i}" for i in range(objects)]
    for k in keys:
        s3.put_object(Bucket=bucket, Key=k, Body=body)
    return keys


def _ranges(size: int, piece: int) -> list[tuple[int, int]]:
    if piece <= 0 or piece >= size:
        return [(0, size - 1)]
    return [(a, min(a + piece, size) - 1) for a in range(0, size, piece)]


def read_once(s3: Any, bucket: str, keys: list[str], size: int, piece: int, parallel: int,
              timeout_s: float = 600.0) -> dict[str, Any]:
    """Every object read once with ``parallel`` ranged GETs of ``piece`` bytes in flight."""
    urls = {k: s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": k}, ExpiresIn=3600)
            for k in keys}
    jobs = [(urls[k], a, b) for k in keys for a, b in _ranges(size, piece)]
    with tempfile.NamedTemporaryFile("w", suffix=".curl", delete=False) as cfg:
        for i, (url, a, b) in enumerate(jobs):
            if i:
                cfg.write("next\n")
            cfg.write(f'url = "{url}"\nrange = {a}-{b}\noutput = /dev/null\nfail\nsilent\n'
                      'write-out = "%{size_download}\\n"\n')
    try:
        cpu0, t0 = _children_cpu(), time.perf_counter()
        p = subprocess.run(["curl", "--parallel", "--parallel-max", str(parallel), "--config", cfg.name],
                           capture_output=True, text=True, timeout=timeout_s)
        took, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    finally:
        os.unlink(cfg.name)
    got = sum(int(x) for x in p.stdout.split() if x.isdigit())
    if p.returncode != 0 or got != len(keys) * size:
        raise RuntimeError(f"raw GETs failed (curl rc {p.returncode}, {got} of {len(keys) * size} bytes): "
                           f"{p.stderr[-500:]}")
    return {"piece_bytes": piece or size, "parallel": parallel, "gets": len(jobs), "bytes": got, "load_s": took,
            "gbps": got / took / 1e9, "cpu_s": cpu}


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def read_run(s3: Any, bucket: str, keys: list[str], size: int) -> dict[str, Any]:
    """One run: every shape of ``SHAPES`` once; the fastest is the run's result."""
    tries = [read_once(s3, bucket, keys, size, piece, parallel) for piece, parallel in SHAPES]
    best = max(tries, key=lambda t: t["gbps"])
    return {**best, "tries": tries}
