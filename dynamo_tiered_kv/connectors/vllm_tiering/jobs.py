"""Runs the tier's store and load jobs on our own threads; the scheduler thread only enqueues.

``submit`` never blocks: it hands a job to a small thread pool and returns. Every submitted job
produces exactly one ``JobResult``, collected by ``finished`` (the scheduler's poll), also when it
raised or the runner had already stopped. ``wait_idle`` is vLLM's ``drain_jobs``: it returns
once no job runs or waits, so nothing of ours touches the primary memoryview any more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from vllm.v1.kv_offload.tiering.base import JobResult

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._lock = threading.Condition()
        self._in_flight = 0
        self._done: list[JobResult] = []
        self._stopped = False

    def submit(self, job_id: int, fn: Callable[[], JobResult]) -> None:
        with self._lock:
            if self._stopped:
                self._done.append(JobResult(job_id=job_id, success=False))
                return
            self._in_flight += 1
        try:
            self._pool.submit(self._run, job_id, fn)
        except RuntimeError:  # the pool shut down between the check and the submit
            self._finish(JobResult(job_id=job_id, success=False))

    def _run(self, job_id: int, fn: Callable[[], JobResult]) -> None:
        try:
            result = fn()
        except Exception:
            log.exception("secondary tier job %d failed", job_id)
            result = JobResult(job_id=job_id, success=False)
        self._finish(result)

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._done.append(result)
            self._in_flight -= 1
            self._lock.notify_all()

    def finished(self) -> list[JobResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    @property
    def busy(self) -> bool:
        return self._in_flight > 0

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0, timeout)

    def stop(self) -> None:
        """Refuse new jobs (they fail at once) and let the accepted ones finish."""
        with self._lock:
            self._stopped = True
        self._pool.shutdown(wait=True)
