"""A restore stops at its deadline between chunks, host-tier (in-place) chunks included."""

from __future__ import annotations

import time

from dynamo_tiered_kv.tiers.host import HostTier
from tests.test_pacing import stored
from tests.test_store import REC, block_bytes, make_layout


class _HeldUntilDeadline:
    """A pacer of a busy engine that holds the first slice back until the restore's deadline passed."""

    def __init__(self) -> None:
        self.admitted = 0

    def admit(self, deadline: float | None) -> None:
        self.admitted += 1
        if self.admitted == 1 and deadline is not None:
            while time.monotonic() <= deadline:
                time.sleep(max(0.001, deadline - time.monotonic()))

    def spent(self, seconds: float) -> None:
        pass

    def limiting(self) -> bool:
        return True


def test_host_restore_past_its_deadline_stops_and_fails_the_rest() -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    host.load_chunk_bytes = 2 * REC  # several chunks: the deadline falls between two of them
    store, pool, src, keys = stored(host, 12, seed=5, load_first_chunk_bytes=2 * REC, load_chunk_bytes=2 * REC)
    try:
        assert host.reads_in_place
        dst, ids = make_layout(64), list(range(20, 32))
        pacer = _HeldUntilDeadline()
        res = store.load(dst, ids, keys, timeout=0.3, pacer=pacer)
        assert res.loaded_block_ids == ids[:2]  # the chunk admitted at the deadline, nothing after it
        assert res.failed_block_ids == ids[2:]
        assert pacer.admitted == 1
        assert all(block_bytes(dst, d) == block_bytes(src, s) for d, s in zip(ids[:2], range(1, 3)))
        assert pool.free_count == len(pool.slabs)
    finally:
        store.close()
        pool.close()


def test_restore_within_its_deadline_restores_every_chunk() -> None:
    host = HostTier(64 * REC, chunk_bytes=REC, pin=False)
    host.load_chunk_bytes = 2 * REC
    store, pool, src, keys = stored(host, 12, seed=6, load_first_chunk_bytes=2 * REC, load_chunk_bytes=2 * REC)
    try:
        dst, ids = make_layout(64), list(range(20, 32))
        res = store.load(dst, ids, keys, timeout=30)
        assert res.loaded_block_ids == ids and res.stages.chunks == 6
        assert all(block_bytes(dst, d) == block_bytes(src, s) for d, s in zip(ids, range(1, 13)))
    finally:
        store.close()
        pool.close()
