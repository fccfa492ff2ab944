"""Asynchronous onboarding: restores run on background threads while the batch keeps decoding.

vLLM's protocol for an asynchronous load (``get_num_new_matched_tokens`` returned ``(n, True)``):
vLLM allocates the request's blocks, parks it in ``WAITING_FOR_REMOTE_KVS`` and sends the load in
the step's metadata; ``start_load_kv`` only submits it here. Every step, ``get_finished`` reports
the requests whose restore is over (``finished_recving``), and the same step's
``get_block_ids_with_load_errors`` the blocks that failed: vLLM rolls the request back to its first
failed block, caches only the blocks before it, and schedules it. With TP/PP every worker reports
its own restore; vLLM releases the request once all of them have.

Rules this module keeps:

* A restore is reported only after its thread returned from ``TieredStore.load`` (which writes
  nothing into engine memory once it returns). vLLM keeps the blocks of a request aborted in
  ``WAITING_FOR_REMOTE_KVS`` until every worker reported it (``finish_requests`` delays the free;
  ``_update_from_kv_xfer_finished`` frees them), so nothing scatters into reallocated blocks.
* One deadline per restore, from its submission (time queued behind other restores counts).
* A restore of a request that finished (aborted) before its thread picked it up is skipped.
* Failures and the finish are reported in the same step (vLLM requires failed blocks no later
  than the step that reports the request finished).
* After a cache reset (new weights) restores still in flight report every block failed.
* A restore's device work orders after the engine's point when vLLM started it (``mark``,
  recorded on the engine thread at submission), not after forwards the engine queued since.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: load(block_ids, keys, timeout_s, mark) -> LoadResult-like (loaded_block_ids, failed_block_ids,
#: tier_per_block); ``mark``: what ``submit`` was given (the engine's device event, or None)
LoadFn = Callable[[list[int], list[Any], float, Any], Any]


@dataclass
class Restored:
    """One request's finished restore, as ``get_finished`` reports it."""

    req_id: str
    failed_block_ids: list[int]
    tier_per_block: list[str]
    queued_s: float  # submission -> a thread started it
    load_s: float  # the thread's load call(s)
    engine_wait_s: float  # submission -> reported to vLLM
    #: ``get_finished`` calls (engine steps) that found it still running; 0: reported at the first
    steps: int = 0
    sync: bool = False  # loaded synchronously in the step that scheduled it (not through this module)


@dataclass
class _Job:
    req_id: str
    block_ids: list[int]
    keys: list[Any]
    submitted: float
    deadline: float
    started: float | None = None
    load_s: float = 0.0
    polls: int = 0  # polls that found it (or a sibling of its request) still running
    done: bool = False
    cancelled: bool = False  # the request finished: skip if not started yet
    stale: bool = False  # the cache was reset meanwhile: every block counts as failed
    failed: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    future: Future[None] | None = None
    mark: Any = None  # the engine's point the restore's device work orders after (opaque here)


class Onboarder:
    """Runs restores on ``threads`` background threads; the engine thread only submits and polls
    (both take one short lock, never wait on a restore)."""

    def __init__(self, load: LoadFn, timeout_s: float, threads: int = 4) -> None:
        self._load = load
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dtkv-onboard")
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # notified whenever a restore ends
        self._jobs: dict[str, list[_Job]] = {}  # per request: normally one; all reported together
        self._closed = False

    def submit(self, req_id: str, block_ids: Sequence[int], keys: Sequence[Any], mark: Any = None) -> None:
        """Queue a restore; ``mark`` is handed to the load function as is (engine thread)."""
        now = time.monotonic()
        job = _Job(req_id, list(block_ids), list(keys), now, now + self.timeout_s, mark=mark)
        with self._lock:
            self._jobs.setdefault(req_id, []).append(job)
            if self._closed:
                job.done, job.failed = True, list(job.block_ids)
                return
        job.future = self._pool.submit(self._run, job)

    def submit_failed(self, req_id: str, block_ids: Sequence[int]) -> None:
        """A restore that cannot run (no store): reported at the next poll with every block failed."""
        now = time.monotonic()
        job = _Job(req_id, list(block_ids), [], now, now, done=True, failed=list(block_ids))
        with self._lock:
            self._jobs.setdefault(req_id, []).append(job)

    def _run(self, job: _Job) -> None:
        with self._lock:
            skip = job.cancelled or job.stale or self._closed
            job.started = time.monotonic()
        failed, tiers = list(job.block_ids), []
        left = job.deadline - job.started
        if skip:
            pass
        elif left <= 0:
            log.warning("request %s: restore of %d blocks queued past its deadline (%.1fs); recomputed",
                        job.req_id, len(job.block_ids), self.timeout_s)
        else:
            try:
                res = self._load(job.block_ids, job.keys, left, job.mark)
                failed, tiers = list(res.failed_block_ids), list(res.tier_per_block)
            except Exception:  # a restore must end in a report, whatever happened: recompute
                log.exception("request %s: restore failed; its blocks are recomputed", job.req_id)
        with self._lock:
            job.load_s = time.monotonic() - job.started
            job.failed, job.tiers, job.done = failed, tiers, True
            self._ended.notify_all()

    def poll(self, finished_req_ids: Iterable[str] = ()) -> list[Restored]:
        """Requests whose every restore is over (each reported once); ``finished_req_ids``: requests
        vLLM finished meanwhile, whose restores are skipped if not started."""
        now = time.monotonic()
        out: list[Restored] = []
        with self._lock:
            for req_id in finished_req_ids:
                for job in self._jobs.get(req_id, ()):
                    job.cancelled = True
            for req_id, jobs in list(self._jobs.items()):
                if not all(j.done for j in jobs):
                    jobs[0].polls += 1
                    continue
                del self._jobs[req_id]
                failed: list[int] = []
                tiers: list[str] = []
                for j in jobs:
                    failed += j.block_ids if j.stale else j.failed
                    tiers += [] if j.stale else j.tiers
                first = min(j.submitted for j in jobs)
                started = max((j.started or j.submitted) for j in jobs)
                out.append(Restored(req_id, failed, tiers, started - first, sum(j.load_s for j in jobs), now - first,
                                    steps=jobs[0].polls))
        return out

    def wait_for_any(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` (GIL released) until some request's restores are all over;
        True if one is ready to be polled. For idle engine steps: vLLM's engine loop runs back to
        back while every request waits for its KV (in-process engines without any sleep), and a
        Python loop that never waits starves the restore threads of the GIL (each hand-off then
        takes up to the interpreter's 5 ms switch interval)."""

        def ready() -> bool:
            return any(all(j.done for j in jobs) for jobs in self._jobs.values())

        with self._lock:
            return self._ended.wait_for(ready, timeout_s) if self._jobs else False

    def reset(self) -> None:
        """The weights changed: restores in flight bring old KV; report all their blocks failed."""
        with self._lock:
            for jobs in self._jobs.values():
                for j in jobs:
                    j.stale = True

    def __len__(self) -> int:
        """Requests with a restore not yet reported."""
        with self._lock:
            return len(self._jobs)

    def quiesce(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every submitted restore to end (before the engine's KV
        memory is released for sleep); True if none is left running. Results stay to be polled."""
        with self._lock:
            futures = [j.future for jobs in self._jobs.values() for j in jobs if j.future is not None]
        _, pending = wait(futures, timeout=timeout_s)
        return not pending

    def close(self, timeout_s: float) -> bool:
        """Skip queued restores and wait up to ``timeout_s`` for running ones (they end by their
        deadline); True if none is left running."""
        with self._lock:
            self._closed = True
            futures = [j.future for jobs in self._jobs.values() for j in jobs if j.future is not None]
        _, pending = wait(futures, timeout=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if pending:
            log.warning("%d restores still running at shutdown", len(pending))
        return not pending
