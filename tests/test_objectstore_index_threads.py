"""The object index is read from engine threads while the tier's loop rewrites it.

``contains``/``size_of``/``len`` run on the lookup thread, in ``store.reads.pipeline`` on engine and
onboarding threads and in the KV-events callback; refresh, merges, single puts, removals and
compactions run on the tier's loop meanwhile. A reader must never raise and never miss a key
that stays indexed the whole time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dynamo_tiered_kv.testing.records import TEST_NAMESPACE, make_record, random_key
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend, ObjectTier
from dynamo_tiered_kv.tiers.objectstore.index import CompactObjectIndex, split_keys

STRESS_S = 3.0
#: rounds run whatever the machine's speed (a slow or loaded CPU gets through fewer in STRESS_S)
MIN_ROUNDS = 8
READERS = 3


class _Readers:
    """Threads calling ``probe(key)`` on the stable keys (each must stay found) until stopped."""

    def __init__(self, stable: list[bytes], probe: Callable[[bytes], bool], extra: Callable[[], object]) -> None:
        self.errors: list[BaseException] = []
        self.misses: list[bytes] = []
        self.calls = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(stable[i::READERS], probe, extra), daemon=True)
                         for i in range(READERS)]

    def __enter__(self) -> _Readers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        assert not any(t.is_alive() for t in self._threads)

    def _run(self, keys: list[bytes], probe: Callable[[bytes], bool], extra: Callable[[], object]) -> None:
        n = 0
        while not self._stop.is_set():
            for k in keys:
                try:
                    if not probe(k):
                        self.misses.append(k)
                    if n % 64 == 0:
                        extra()
                except BaseException as e:  # the assertion reports it
                    self.errors.append(e)
                    return
                n += 1
        self.calls += n


def test_index_readers_on_threads_while_the_owner_merges_puts_removes_and_compacts() -> None:
    rng = np.random.default_rng(7)
    idx = CompactObjectIndex()
    created = np.arange(64, dtype=np.float64)
    stable = [rng.bytes(16) for _ in range(2000)]
    k0, k1 = split_keys(b"".join(stable))
    idx.merge(k0, k1, np.zeros(2000, np.uint32), np.arange(2000, dtype=np.uint32), np.full(2000, 512, np.uint32),
              created)
    with _Readers(stable, idx.__contains__, lambda: (len(idx), idx.get(stable[0]))) as readers:
        end = time.monotonic() + STRESS_S
        rounds = 0
        while (time.monotonic() < end or rounds < MIN_ROUNDS) and not readers.errors:
            rounds += 1
            obj = 1 + rounds % 60
            churn = [rng.bytes(16) for _ in range(3000)]
            c0, c1 = split_keys(b"".join(churn))
            sizes = rng.integers(1, 4, 3000).astype(np.uint32) * 512  # new record sizes: the length table grows
            idx.merge(c0, c1, np.full(3000, obj, np.uint32), np.arange(3000, dtype=np.uint32), sizes, created)
            for i, k in enumerate(churn[:300]):
                idx.put(k, obj, i, 100 + rounds % 200)  # a second size table path, revives after removes
            for k in churn[::5]:
                idx.remove(k)
            for i, k in enumerate(churn[::10]):
                idx.put(k, obj, i, 4096)  # put back after a remove
            idx.compact()
            idx.remove_objects(np.array([obj], np.uint32))
            idx.compact()
    assert not readers.errors, f"a reader raised {readers.errors[0]!r} after {rounds} rounds"
    assert not readers.misses, f"{len(readers.misses)} lookups missed a key indexed all along"
    assert rounds >= MIN_ROUNDS and all(idx.get(k) is not None for k in stable)


async def test_tier_lookups_on_threads_while_refresh_merges_other_nodes_objects(tmp_path: Path) -> None:
    writer = ObjectTier(LocalDirBackend(tmp_path), namespace=TEST_NAMESPACE)
    reader = ObjectTier(LocalDirBackend(tmp_path), namespace=TEST_NAMESPACE)
    for t in (writer, reader):
        await t.open()
        assert await t.wait_ready(30)
    stable = [random_key(i, b"stable") for i in range(256)]
    await reader.write_many([(k, memoryview(make_record(k, i))) for i, k in enumerate(stable)])
    sizes = {k: reader.size_of(k) for k in stable}

    def lookup(k: bytes) -> bool:
        return reader.contains(k) and reader.size_of(k) == sizes[k]

    loop_lag = asyncio.get_running_loop()
    with _Readers(stable, lookup, lambda: (len(reader._cat), reader.usage())) as readers:
        end = loop_lag.time() + STRESS_S
        rounds = 0
        while (loop_lag.time() < end or rounds < MIN_ROUNDS) and not readers.errors:
            rounds += 1
            batch = [random_key(i, b"w%d" % rounds) for i in range(200)]
            await writer.write_many([(k, memoryview(make_record(k, i))) for i, k in enumerate(batch)])
            await reader.refresh(full=rounds % 3 == 0)  # incremental listings merge, full ones forget too
            mine = [random_key(i, b"r%d" % rounds) for i in range(20)]
            await reader.write_many([(k, memoryview(make_record(k, i))) for i, k in enumerate(mine)])
            for k in batch[::7]:
                await reader.delete(k)  # removals from the base columns
            if rounds % 4 == 0:
                await reader.write_snapshot()  # compacts the index
    for t in (writer, reader):
        await t.close()
    assert not readers.errors, f"a reader raised {readers.errors[0]!r} after {rounds} rounds"
    assert not readers.misses, f"{len(readers.misses)} lookups missed a key indexed all along"
    assert rounds >= MIN_ROUNDS
