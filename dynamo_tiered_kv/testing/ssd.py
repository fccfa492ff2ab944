"""Helpers for tests of the SSD tier and of code that reads any tier record by record."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..tiers.base import Tier


async def open_ssd_tier(path: Path, **kw: Any) -> Any:
    """An opened ``SSDTier`` with small test defaults (64 MiB, 256 KiB segments, no idle seal).

    Opening is bounded (20 s): recovery must never block, e.g. on a FIFO named like a segment.
    """
    from ..tiers.ssd import SSDTier

    kw.setdefault("capacity_bytes", 64 << 20)
    kw.setdefault("segment_bytes", 256 << 10)
    kw.setdefault("idle_seal_s", None)
    t = SSDTier(path, **kw)
    await asyncio.wait_for(t.open(), 20)
    assert t.available, t.disabled_reason
    return t


async def read_whole(t: Tier, key: bytes) -> bytes | None:
    """The whole record under ``key``, or None when the tier does not serve it."""
    n = t.size_of(key)
    if n is None:
        return None
    buf = bytearray(n)
    return None if await t.read_into(key, memoryview(buf)) is None else bytes(buf)
