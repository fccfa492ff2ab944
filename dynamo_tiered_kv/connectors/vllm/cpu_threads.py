"""Threads a synchronous restore may verify+scatter with on a CPU engine's own thread.

A restore small enough to run synchronously runs on the engine's thread right after a forward.
The engine's OpenMP workers, one per core it owns, do not sleep the moment the forward's parallel
regions end: libgomp spins first by default (``GOMP_SPINCOUNT``), Intel OpenMP for
``KMP_BLOCKTIME`` ms (vLLM sets 5). A decode helper woken on such a core shares it with a spinning
worker and finishes late, and the restore waits for its slowest range. Measured on a 2-vCPU Xeon VM
(AVX-512, AMX; 2k-token prompt, 15 MiB from the host tier, 4 interleaved runs of `dtkv bench
restore`, medians of 5 rounds each): one thread waited 3.2-4.5 ms in the engine, two threads
3.5-5.0 ms; with ``OMP_WAIT_POLICY=passive`` two threads 2.1-2.9 ms, but the engine's 256-token
prefill took up to 8 ms longer in 3 of 4 runs (its team wakes from sleep in every parallel
region). So a synchronous restore fans out over the cores the OpenMP team leaves free, or over
all of them when the team's workers sleep at once.
"""
from __future__ import annotations

import os
from collections.abc import Mapping


def sync_decode_threads(omp_threads: int, cpus: int, env: Mapping[str, str]) -> int:
    """Threads (the engine's own included) for a restore on the engine's thread, given the engine's
    OpenMP team size, the CPUs this process may run on and its environment."""
    passive = env.get("OMP_WAIT_POLICY", "").strip().lower() == "passive" \
        or env.get("KMP_BLOCKTIME", "").strip() == "0"
    if passive:
        return max(1, cpus)
    return max(1, cpus - max(1, omp_threads) + 1)


def engine_sync_decode_threads() -> int:
    """``sync_decode_threads`` for this process (torch's intra-op team, its CPU affinity)."""
    import torch  # the engine's; imported late so this module loads without it

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return sync_decode_threads(torch.get_num_threads(), cpus, os.environ)
