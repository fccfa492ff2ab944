"""Verify+scatter of one load chunk fanned out over a few threads.

A host-tier restore is verify+scatter alone (the records are already in memory): one thread does
it at about half a memcpy's speed (measured 4.4 GB/s against 8 GB/s), which on a fast engine is a
third of the restored request's TTFT. The compiled decoder drops the GIL, so contiguous record
ranges verified and scattered on several threads run in parallel; ranges are disjoint engine
blocks, so no two threads write the same bytes. Used only while nobody limits the restore's CPU
(``pacing``): on a busy CPU engine the cores belong to the forward.

Which threads: on the main thread (where a CPU engine runs its forward steps, and with them its
synchronous restores) the ranges run on the OpenMP team torch runs the forward on. After each
parallel region of the step that team's workers spin-wait on the other cores (libgomp's default
wait policy), through much of a restore that follows: a helper thread of our own then shares a
core with a spinning worker, or waits for one, while the worker does nothing useful. Given the
ranges, the spinning workers do them, with no wake-up. Other threads use a small pool of our own.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

#: threads per chunk, the caller's included (more rarely helps: memory bandwidth is shared)
WAYS = max(1, min(4, os.cpu_count() or 1))
#: smallest range worth a thread (per-call overhead, a wake-up)
MIN_BYTES_PER_WAY = 2 << 20
#: run the main thread's ranges on torch's OpenMP team where there is one (tests turn it off)
USE_ENGINE_TEAM = True

#: process-wide, shared by every store and loading thread, idle when unused; created once under
#: ``_pool_lock`` (loads on several threads may start at once), never replaced
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()

_TEAM_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
#: ``GOMP_parallel`` of torch's OpenMP runtime, None where there is none; resolved once (main thread)
_gomp_parallel: Any = False


def _helpers() -> ThreadPoolExecutor:
    global _pool
    pool = _pool
    if pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max(1, WAYS - 1), thread_name_prefix="dtkv-decode")
            pool = _pool
    return pool


def _find_gomp_parallel() -> Any:
    """``GOMP_parallel`` of the OpenMP runtime loaded for torch (libgomp; Intel's and LLVM's
    runtimes export it too), else None: torch without OpenMP, no /proc, an unknown runtime."""
    try:
        import torch

        if not torch.backends.openmp.is_available():
            return None
        with open("/proc/self/maps") as f:  # mapped files by real name (libgomp.so.1.0.0, libgomp-<hash>.so.1)
            paths = sorted({ln.split()[-1] for ln in f if ".so" in ln and ln.split()[-1].startswith("/")})
    except (ImportError, OSError):
        return None
    runtimes = [p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp5", "libomp"))]
    torch_dir = os.path.dirname(torch.__file__)
    own = [p for p in runtimes if p.startswith((torch_dir + os.sep, torch_dir + ".libs" + os.sep))]
    pick = own or (runtimes if len(runtimes) == 1 else [])  # two foreign runtimes: torch's is unknown
    for p in pick:
        try:
            fn = ctypes.CDLL(p).GOMP_parallel
        except (OSError, AttributeError):
            continue
        fn.argtypes = [_TEAM_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        fn.restype = None
        return fn
    return None


def engine_team() -> tuple[Any, int] | None:
    """(``GOMP_parallel``, team size) when the calling thread is the main thread and torch runs on
    an OpenMP team of at least two threads there; else None."""
    global _gomp_parallel
    if not USE_ENGINE_TEAM or threading.current_thread() is not threading.main_thread():
        return None
    if _gomp_parallel is False:  # only the main thread gets here: no lock needed
        _gomp_parallel = _find_gomp_parallel()
    if _gomp_parallel is None:
        return None
    import torch

    size = torch.get_num_threads()
    return (_gomp_parallel, size) if size >= 2 else None


def _on_team(gomp_parallel: Any, size: int, bounds: list[int],
             decode: Callable[[int, int], list[Any]]) -> list[Any]:
    """The ranges of ``bounds`` on the calling thread's OpenMP team (it takes part); each member
    takes the next range until none is left. Returns once the team has finished every range."""
    ranges = len(bounds) - 1
    results: list[list[Any] | None] = [None] * ranges
    errors: list[BaseException] = []
    taken = itertools.count()  # next() is atomic under the GIL

    def body(_: int | None) -> None:  # on each team member, holding the GIL only around decode's Python
        try:
            while (i := next(taken)) < ranges:
                results[i] = decode(bounds[i], bounds[i + 1])
        except BaseException as e:  # raised on the caller once every range ended
            errors.append(e)

    cb = _TEAM_BODY(body)  # kept alive until GOMP_parallel returns (its implicit barrier)
    gomp_parallel(cb, None, size, 0)
    if errors:
        raise errors[0]
    return [x for r in results for x in r or ()]


def fan_out(n: int, record_bytes: int, decode: Callable[[int, int], list[Any]]) -> list[Any]:
    """``decode(a, b)`` over ``[0, n)`` cut into up to ``WAYS`` contiguous ranges, the calling
    thread taking part (on ``engine_team`` or with a pool of our own); the per-record results in
    order. Returns (or raises) only after every range finished, so nothing writes engine memory
    once the caller moves on."""
    ways = min(WAYS, n * record_bytes // MIN_BYTES_PER_WAY)
    if ways < 2:
        return decode(0, n)
    team = engine_team()
    if team is not None:
        gomp_parallel, size = team
        ways = min(ways, size)
        return _on_team(gomp_parallel, ways, [n * i // ways for i in range(ways + 1)], decode)
    bounds = [n * i // ways for i in range(ways + 1)]
    pool = _helpers()
    futures = [pool.submit(decode, bounds[i], bounds[i + 1]) for i in range(1, ways)]
    try:
        out = decode(bounds[0], bounds[1])
    finally:
        wait(futures)
    for f in futures:
        out += f.result()
    return out
