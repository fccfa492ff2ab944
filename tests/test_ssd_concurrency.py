"""Several worker processes on one host: per-rank directories, one flock-ed writer per directory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from dynamo_tiered_kv.cli import main
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.ssd import SSDTier

SHAPE = small_shape(num_layers=2)
N = 60

WORKER = textwrap.dedent("""
    import asyncio, sys
    from dynamo_tiered_kv.testing import make_record, random_key, small_shape
    from dynamo_tiered_kv.tiers.ssd import SSDTier

    root, rank, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hold"

    async def main():
        t = SSDTier(root, rank=rank, capacity_bytes=64 << 20, segment_bytes=256 << 10, idle_seal_s=None)
        await t.open()
        assert t.available, t.disabled_reason
        items = []
        for i in range({n}):
            k = random_key(i, bytes([rank]))
            items.append((k, make_record(k, rank * 1000 + i, shape=small_shape(num_layers=2))))
        for j in range(0, len(items), 7):
            await t.write_many((k, memoryview(v)) for k, v in items[j:j + 7])
        for k, v in items:
            buf = bytearray(len(v))
            assert await t.read_into(k, memoryview(buf)) == len(v) and bytes(buf) == v
        print("ready", flush=True)
        if hold:
            sys.stdin.read()
        await t.close()

    asyncio.run(main())
""").format(n=N)


def _spawn(root: Path, rank: int, hold: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(rank), "hold" if hold else "go"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _expected(rank: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(N):
        k = random_key(i, bytes([rank]))
        out.append((k, make_record(k, rank * 1000 + i, shape=SHAPE)))
    return out


async def _verify(root: Path, rank: int) -> None:
    t = SSDTier(root, rank=rank, capacity_bytes=64 << 20, idle_seal_s=None)
    await t.open()
    try:
        assert t.available and t.usage().num_blocks == N
        for k, v in _expected(rank):
            buf = bytearray(len(v))
            assert await t.read_into(k, memoryview(buf)) == len(v) and bytes(buf) == v
    finally:
        await t.close()


async def test_ranks_write_concurrently_without_interference(tmp_path: Path) -> None:
    procs = [_spawn(tmp_path, r) for r in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    for r in range(3):
        await _verify(tmp_path, r)
    assert main(["fsck", str(tmp_path)]) == 0


async def test_second_process_on_a_rank_is_locked_out_until_the_first_exits(tmp_path: Path) -> None:
    holder = _spawn(tmp_path, 0, hold=True)
    try:
        assert holder.stdout is not None
        for line in holder.stdout:  # NIXL logs to stdout too
            if line.strip() == "ready":
                break
        t = SSDTier(tmp_path, rank=0, capacity_bytes=64 << 20, idle_seal_s=None)
        await t.open()
        assert not t.available and "locked" in (t.disabled_reason or "")
        await t.close()
    finally:
        _, err = holder.communicate("", timeout=60)
    assert holder.returncode == 0, err
    await _verify(tmp_path, 0)
