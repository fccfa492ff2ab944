"""No write into a caller's buffer after ``read_many`` returns or raises.

The store releases (and reuses) the staging slab as soon as a read fails, so every ranged GET of
that read must have stopped first: a sibling run of a failed one, a run past the timeout, and the
local-directory backend's worker thread (which cannot be cancelled) included.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.errors import TierUnavailable
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.objectstore import ObjectTier, localdir
from dynamo_tiered_kv.tiers.objectstore.localdir import LocalDirBackend

KA, KB = b"A" * 16, b"B" * 16
GUARD_S = 10  # only bounds a hang; never a timing assertion


async def _two_objects(root: Path, **kw: object) -> tuple[ObjectTier, LocalDirBackend]:
    be = LocalDirBackend(root)
    tier = ObjectTier(be, verify_reads=False, **kw)  # type: ignore[arg-type]
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    await tier.write_many([(KA, memoryview(b"a" * 4096))])  # data object 1
    await tier.write_many([(KB, memoryview(b"b" * 4096))])  # data object 2
    return tier, be


def _requests(slab: np.ndarray) -> list[ReadRequest]:
    return [ReadRequest(KA, memoryview(slab[:4096])), ReadRequest(KB, memoryview(slab[4096:]))]


async def test_failed_run_stops_sibling_runs_before_raising(tmp_path: Path) -> None:
    tier, be = await _two_objects(tmp_path)
    real, obj_a = be.get_range, tier.location(KA)[0]  # type: ignore[index]
    gate, b_done = asyncio.Event(), asyncio.Event()

    async def get_range(name: str, off: int, dests: Sequence[memoryview]) -> int | None:
        if name == obj_a:
            raise TierUnavailable("GET failed after retries")
        try:
            await gate.wait()  # the sibling is still in flight when the first run fails
            return await real(name, off, dests)
        finally:
            b_done.set()

    be.get_range = get_range  # type: ignore[method-assign]
    slab = np.zeros(8192, np.uint8)
    with pytest.raises(TierUnavailable):
        await tier.read_many(_requests(slab))
    slab[:] = 0x77  # the caller reuses the slab
    gate.set()
    await asyncio.wait_for(b_done.wait(), GUARD_S)
    await asyncio.sleep(0)
    assert bytes(slab[4096:]) == b"\x77" * 4096
    await tier.close()


def _blocking_get_range(release: threading.Event, finished: threading.Event):  # type: ignore[no-untyped-def]
    real = localdir._get_range

    def get_range(path: Path, offset: int, dests: Sequence[memoryview]) -> int | None:
        try:
            release.wait(GUARD_S)
            return real(path, offset, dests)
        finally:
            finished.set()
    return get_range


async def test_timeout_returns_only_after_the_localdir_thread_finished(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tier, _ = await _two_objects(tmp_path, read_timeout_s=0.05)
    release, finished = threading.Event(), threading.Event()
    monkeypatch.setattr(localdir, "_get_range", _blocking_get_range(release, finished))
    asyncio.get_running_loop().call_later(0.3, release.set)  # the thread outlives the timeout
    slab = np.zeros(8192, np.uint8)
    with pytest.raises(TierUnavailable):
        await tier.read_many(_requests(slab))
    assert finished.is_set(), "read_many raised while a worker thread could still write the slab"
    await tier.close()


async def test_cancelled_localdir_get_range_waits_for_its_thread(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    be = LocalDirBackend(tmp_path)
    await be.open()
    await be.put_object("obj", memoryview(b"x" * 4096))
    release, finished = threading.Event(), threading.Event()
    monkeypatch.setattr(localdir, "_get_range", _blocking_get_range(release, finished))
    buf = bytearray(4096)
    task = asyncio.ensure_future(be.get_range("obj", 0, [memoryview(buf)]))
    await asyncio.sleep(0.05)  # let the thread start (the thread cannot finish before release)
    task.cancel()
    asyncio.get_running_loop().call_later(0.2, release.set)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set() and bytes(buf) == b"x" * 4096
    await be.close()
