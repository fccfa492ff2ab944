"""``TieredStore.load`` stops waiting at its deadline on every read path the store has.

A stall is injected into each path's real read (the host tier's record copy, the SSD tier's
``preadv`` through its I/O object, the object tier's ranged GET) and holds it until the test
releases it. The load must return within its timeout plus a margin for a loaded 2-core machine,
report the stalled blocks failed and serve nothing wrong; once the stalled read returns, every
staging slab, segment reference, host pin and GET slot is free again, no late byte reached the
engine's blocks, and a second load restores everything (nothing was lost).

A host-tier restore read in place has no read to stall (its records are verified+scattered from
the host arena on the calling thread): its one wait is the pacer's admission of verify+scatter,
held here as a busy engine would hold it.

Adding a path is one ``ReadPath`` line in ``PATHS``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import dynamo_tiered_kv.store.reads.direct as sdr
from dynamo_tiered_kv.blocks.keys import parents_of
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.tiers.base import Tier
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.ssd import SSDTier
from tests.test_store import REC, block_bytes, keys_for, make_layout, make_store

TIMEOUT_S = 1.0  # the load's timeout (the reads before a stall must fit in it on a busy disk)
MARGIN_S = 1.5  # wake-ups on a loaded 2-core VM come late; far below the stall
STALL_CAP_S = 8.0  # an injected stall ends by itself after this long (a wait it did not bound)
SLAB_RECORDS = 8


class Stall:
    """Holds every read from the ``skip + 1``-th on until ``release`` is set (``STALL_CAP_S`` at
    most). Reading threads call ``hold``/``hold_async``; the test thread sets ``release``."""

    def __init__(self, skip: int = 0) -> None:
        self.skip = skip
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls = 0
        self.threads: list[str] = []  # threads whose read was held

    def _admit(self) -> bool:
        with self.lock:
            self.calls += 1
            held = self.calls > self.skip
            if held:
                self.threads.append(threading.current_thread().name)
            return held

    def hold(self) -> None:
        if self._admit():
            self.release.wait(STALL_CAP_S)

    async def hold_async(self) -> None:
        if self._admit():
            end = time.monotonic() + STALL_CAP_S
            while not self.release.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.01)


class HeldPacer:
    """A busy engine's pacer whose step does not come: verify+scatter is held until ``stall`` is
    released or, as the pacer contract says, the restore's deadline passed."""

    def __init__(self, stall: Stall) -> None:
        self.stall = stall

    def admit(self, deadline: float | None) -> None:
        if self.stall._admit():
            self.stall.release.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def spent(self, seconds: float) -> None:
        pass

    def limiting(self) -> bool:
        return True


class LoopReadHost(HostTier):
    """Host memory read through the store's loop into a staging slab, as a GPU layout (or any
    layout the compiled decoder does not handle) reads it: the same reads, not done in place."""

    async def read_many(self, requests):  # overriding it is what turns in-place reads off
        return await super().read_many(requests)


# --- the paths -----------------------------------------------------------------------------------
def _host(tmp_path: Path) -> Tier:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    host.load_chunk_bytes = 2 * REC  # several chunks: the deadline falls between two of them
    return host


def _loop_host(tmp_path: Path) -> Tier:
    return LoopReadHost(64 * REC, chunk_bytes=REC, pin=False)


def _ssd(tmp_path: Path) -> Tier:
    return SSDTier(tmp_path / "ssd", capacity_bytes=64 * REC, segment_bytes=64 * REC, io="odirect")


def _object(tmp_path: Path) -> Tier:
    return ObjectTier(LocalDirBackend(tmp_path / "obj"))


def _no_read(tier: Any, stall: Stall) -> None:
    pass  # the pacer holds this path (``HeldPacer``)


def _stall_host_copy(tier: Any, stall: Stall) -> None:
    real = tier.read_sync

    def read_sync(*a: Any, **k: Any) -> Any:
        stall.hold()
        return real(*a, **k)

    tier.read_sync = read_sync


def _stall_ssd_pread(tier: Any, stall: Stall) -> None:
    io = tier._state.io
    real = io.read

    def read(fd: int, bufs: Sequence[Any], offset: int) -> None:
        stall.hold()
        real(fd, bufs, offset)

    io.read = read


def _stall_object_get(tier: Any, stall: Stall) -> None:
    backend = tier.backend
    real = backend.get_range

    async def get_range(*a: Any, **k: Any) -> Any:
        await stall.hold_async()
        return await real(*a, **k)

    backend.get_range = get_range


def _host_unpinned(tier: Any) -> bool:
    return not tier._pins


def _ssd_unreferenced(tier: Any) -> bool:
    return all(s.readers == 0 for s in tier._state.segments.values())


def _object_idle(tier: Any) -> bool:
    return tier._sem._value == tier.max_concurrency  # every ranged-GET slot returned


@dataclass(frozen=True)
class ReadPath:
    name: str
    make: Callable[[Path], Tier]  # the store's only tier
    blocks: int  # blocks stored and restored
    restored: int  # leading blocks read before the stall (they load; every later one fails)
    stall: Callable[[Any, Stall], None]  # inject ``Stall`` into the tier's real read
    idle: Callable[[Any], bool]  # no read reference, pin or slot of the tier left
    skip: int = 0  # reads let through before the stall holds them
    split_from: int | None = None  # a direct load this large is read in two parts
    held_by_pacer: bool = False
    reader: str | None = None  # the held read runs on a thread of this name


PATHS = [
    ReadPath("host-in-place", _host, 12, 2, _no_read, _host_unpinned, held_by_pacer=True),
    ReadPath("host-via-loop", _loop_host, 6, 0, _stall_host_copy, _host_unpinned, reader="dtkv-store"),
    ReadPath("ssd-direct", _ssd, 6, 0, _stall_ssd_pread, _ssd_unreferenced, reader="dtkv-readnow"),
    ReadPath("ssd-direct-rest", _ssd, 8, 6, _stall_ssd_pread, _ssd_unreferenced, skip=1, split_from=4,
             reader="dtkv-readnow"),
    ReadPath("ssd-loop", _ssd, 12, 0, _stall_ssd_pread, _ssd_unreferenced),  # more than a slab: the loop
    ReadPath("object", _object, 6, 0, _stall_object_get, _object_idle, reader="dtkv-store"),
]


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(SLAB_RECORDS * REC, 6, pin=False)
    yield p
    p.close()


def _until(cond: Callable[[], bool], seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_a_stalled_read_fails_its_blocks_at_the_deadline_and_leaks_nothing(
        path: ReadPath, pool: StagingPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if path.split_from is not None:
        monkeypatch.setattr(sdr, "SPLIT_MIN_BYTES", path.split_from * REC)  # tiny test records
    tier = path.make(tmp_path)
    src, keys = make_layout(64, seed=31), keys_for(path.blocks)
    store = make_store([tier], pool, load_chunk_bytes=SLAB_RECORDS * REC, load_first_chunk_bytes=2 * REC)
    stall = Stall(path.skip)
    try:
        assert store.submit_offload(src, list(range(1, path.blocks + 1)), keys, parents_of(keys))
        assert store.drain(10)
        assert store.lookup(keys).num_blocks == path.blocks
        path.stall(tier, stall)
        dst, ids = make_layout(64), list(range(20, 20 + path.blocks))
        before = [block_bytes(dst, d) for d in ids]

        t0 = time.monotonic()
        res = store.load(dst, ids, keys, timeout=TIMEOUT_S, pacer=HeldPacer(stall) if path.held_by_pacer else None)
        took = time.monotonic() - t0

        assert stall.threads, "the stall was never reached: the test missed its path"
        assert took < TIMEOUT_S + MARGIN_S, f"load took {took:.2f}s with a {TIMEOUT_S}s timeout"
        if path.reader is not None:
            assert all(t.startswith(path.reader) for t in stall.threads), stall.threads
        assert res.loaded_block_ids == ids[:path.restored]
        assert res.failed_block_ids == ids[path.restored:]
        stall.release.set()  # the stalled read returns now, into a slab nobody consumes
        assert _until(lambda: pool.free_count == len(pool.slabs)), "a staging slab leaked"
        assert _until(lambda: path.idle(tier)), "a read reference, pin or slot leaked"
        for j, d in enumerate(ids):  # loaded: the right bytes; failed: untouched, also after the late read
            want = block_bytes(src, j + 1) if j < path.restored else before[j]
            assert block_bytes(dst, d) == want, f"block {d} holds wrong bytes"

        again = make_layout(64)
        res = store.load(again, ids, keys, timeout=10)  # nothing lost: every record still served
        assert res.loaded_block_ids == ids
        assert all(block_bytes(again, d) == block_bytes(src, j + 1) for j, d in enumerate(ids))
        assert _until(lambda: pool.free_count == len(pool.slabs))
    finally:
        stall.release.set()
        store.close()
