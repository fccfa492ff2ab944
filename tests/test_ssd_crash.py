"""SIGKILL torture: kill a writer at random points, recover, and check the crash contract.

Contract (docs/SSD.md): after recovery every acknowledged write reads back byte-identical and
verified, every acknowledged delete stays deleted, only the operation in flight at the kill may
or may not have happened, no partial record is ever visible, and the tier accepts new writes.
Trials are chained per directory, so recovery also runs over state left by earlier recoveries;
half the chains run with a small capacity, so segments are evicted while the writer runs (an
evicted key may be absent, but a present key must never hold an outdated or deleted value).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest

from dynamo_tiered_kv.blocks.codec import verify_record
from dynamo_tiered_kv.testing.ssd_torture import KEY_SPACE, key_of, record_of, replay_journal, writer_main
from dynamo_tiered_kv.tiers.ssd import SSDTier

CHAINS = 8
GENERATIONS = 5  # 40 SIGKILLs in all


@pytest.fixture(scope="module")
def forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dynamo_tiered_kv.testing.ssd_torture", "dynamo_tiered_kv.tiers.ssd.tier"])
    return ctx


async def _check(root: Path, base: dict, journal: str, capacity: int) -> dict:
    """Recover ``root`` and check it against the journal; return the observed state."""
    exp = replay_journal(journal, base)
    evictions = capacity < 1 << 40
    tier = SSDTier(root, capacity_bytes=capacity, segment_bytes=128 << 10, idle_seal_s=None)
    await tier.open()
    try:
        assert tier.available, tier.disabled_reason
        observed: dict = {}
        present = set(tier.keys())
        for i in range(KEY_SPACE):
            key = key_of(i)
            allowed = exp.allowed(i, evictions)
            if key not in present:
                assert None in allowed, f"acknowledged key {i} ({allowed[0]}) lost"
                observed[i] = None
                continue
            buf = bytearray(tier.size_of(key) or 0)
            assert await tier.read_into(key, memoryview(buf)) == len(buf)
            verify_record(buf, key=key)  # never a partial or foreign record
            match = [v for v in allowed if v is not None and record_of(i, v[0], v[1]) == bytes(buf)]
            assert match, f"key {i} holds a value that is neither acknowledged nor in flight ({allowed})"
            observed[i] = match[0]
        assert present <= {key_of(i) for i in range(KEY_SPACE)}
        probe = key_of(KEY_SPACE + 7)
        rec = record_of(KEY_SPACE + 7, 1, 0)
        await tier.write(probe, memoryview(rec))  # accepts new writes after recovery
        out = bytearray(len(rec))
        assert await tier.read_into(probe, memoryview(out)) == len(rec) and bytes(out) == rec
        assert await tier.delete(probe)
    finally:
        await tier.close()
    return observed


@pytest.mark.slow
def test_sigkill_torture(tmp_path: Path, forkserver) -> None:
    rng = random.Random(int(os.environ.get("DTKV_TORTURE_SEED", "20261130")))
    kills_with_acks = 0
    for chain in range(CHAINS):
        root = tmp_path / f"chain{chain}"
        io = ("auto", "odirect", "buffered")[chain % 3]
        capacity = 1 << 40 if chain % 2 == 0 else 640 << 10  # odd chains evict while they write
        state: dict = {}
        for gen in range(GENERATIONS):
            journal = tmp_path / f"journal-{chain}-{gen}"
            p = forkserver.Process(target=writer_main,
                                   args=(str(root), str(journal), rng.getrandbits(32), gen + 1, 128 << 10, io,
                                         capacity))
            p.start()
            time.sleep(rng.uniform(0.0, 0.5) if gen else rng.uniform(0.2, 0.6))
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            assert p.exitcode == -signal.SIGKILL, "the writer died before it was killed"
            text = journal.read_text() if journal.exists() else ""
            kills_with_acks += "\nA\n" in "\n" + text
            state = asyncio.run(_check(root, state, text, capacity))
    assert kills_with_acks >= CHAINS * GENERATIONS // 2, "most kills should land after some acknowledged work"
