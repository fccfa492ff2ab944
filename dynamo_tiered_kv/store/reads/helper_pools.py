"""Process-wide helper thread pools, one per purpose, created on first use and idle when unused.

Shared by every store and loading thread in the process (restores on several threads may ask for
one at once); never replaced, so a caller may keep the pool it got.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def helper_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The pool of threads named ``name-*`` (``workers`` of them, fixed by its first caller)."""
    pool = _pools.get(name)
    if pool is None:
        with _lock:
            pool = _pools.get(name)
            if pool is None:
                pool = _pools[name] = ThreadPoolExecutor(max(1, workers), thread_name_prefix=name)
    return pool
