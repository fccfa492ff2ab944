"""Crash-torture harness for the SSD tier: a writer to SIGKILL, and the model to check it against.

The writer (``writer_main``, run in a child process) performs random batched writes, deletes
and seals through a real ``SSDTier`` and logs each operation to an append-only journal *before*
(``I <op>``) and *after* (``A``) it runs. After the kill, ``replay_journal`` turns the journal
into the expected state: every acknowledged operation must have taken effect, and only the last
operation (logged, not acknowledged) may or may not have. Used by tests/test_ssd_crash.py.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field

from .records import make_record, random_key, small_shape

SHAPES = [small_shape(num_layers=n) for n in (1, 2, 5)]
SALT = b"ssd-torture"
KEY_SPACE = 48


def key_of(i: int) -> bytes:
    return random_key(i, SALT)


def record_of(i: int, ver: int, size: int) -> bytes:
    return make_record(key_of(i), ver * 1009 + i, shape=SHAPES[size % len(SHAPES)])


def writer_main(root: str, journal: str, seed: int, generation: int, segment_bytes: int, io: str,
                capacity_bytes: int = 1 << 40) -> None:
    """Run random operations forever (until killed). A small capacity adds evictions."""
    asyncio.run(_writer(root, journal, seed, generation, segment_bytes, io, capacity_bytes))


async def _writer(root: str, journal: str, seed: int, generation: int, segment_bytes: int, io: str,
                  capacity_bytes: int) -> None:
    from ..tiers.ssd.tier import SSDTier

    rng = random.Random(seed)
    tier = SSDTier(root, capacity_bytes=capacity_bytes, segment_bytes=segment_bytes, io=io, idle_seal_s=None)
    await tier.open()
    assert tier.available, tier.disabled_reason
    jfd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ver = generation * 1_000_000
    while True:
        r = rng.random()
        if r < 0.75:
            items = []
            for _ in range(rng.randint(1, 6)):
                ver += 1
                items.append((rng.randrange(KEY_SPACE), ver, rng.randrange(len(SHAPES))))
            os.write(jfd, ("I W " + ",".join(f"{i}:{v}:{s}" for i, v, s in items) + "\n").encode())
            await tier.write_many((key_of(i), memoryview(record_of(i, v, s))) for i, v, s in items)
        elif r < 0.93:
            i = rng.randrange(KEY_SPACE)
            os.write(jfd, f"I D {i}\n".encode())
            await tier.delete(key_of(i))
        else:
            os.write(jfd, b"I S\n")
            await tier.seal()
        os.write(jfd, b"A\n")


@dataclass
class Expected:
    """Acknowledged state (key index -> (ver, size) or None when deleted) and the in-flight op."""

    state: dict[int, tuple[int, int] | None] = field(default_factory=dict)
    pending: list[tuple[int, tuple[int, int] | None]] = field(default_factory=list)

    def allowed(self, i: int, evictions: bool = False) -> list[tuple[int, int] | None]:
        """Values key ``i`` may hold after recovery (None: absent, always allowed with evictions)."""
        out = [self.state.get(i)] + ([None] if evictions else [])
        value = self.state.get(i)
        for j, v in self.pending:  # the in-flight batch may have landed up to any prefix of it
            if j == i:
                value = v
                out.append(value)
        return out


def replay_journal(text: str, base: dict[int, tuple[int, int] | None]) -> Expected:
    """Apply acknowledged operations of a journal to ``base`` (see module docstring)."""
    exp = Expected(dict(base))
    op: list[tuple[int, tuple[int, int] | None]] | None = None
    for line in text.split("\n")[:-1]:  # a torn last line (no newline) never completed
        if line.startswith("I W "):
            op = []
            for part in line[4:].split(","):
                i, v, s = (int(x) for x in part.split(":"))
                op.append((i, (v, s)))
        elif line.startswith("I D "):
            op = [(int(line[4:]), None)]
        elif line == "I S":
            op = []
        elif line == "A" and op is not None:
            for i, v in op:
                exp.state[i] = v
            op = None
    exp.pending = op or []
    return exp
