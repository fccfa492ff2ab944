"""The object tier's background refresh outlives a failing pass: an unexpected error in one refresh
(a bug, a malformed listing) is logged and the next pass runs, so the node keeps seeing other
nodes' writes and tenants' erasures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dynamo_tiered_kv.tiers.objectstore.localdir import LocalDirBackend
from dynamo_tiered_kv.tiers.objectstore.tier import ObjectTier


async def test_refresh_loop_continues_after_an_unexpected_error(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    tier = ObjectTier(LocalDirBackend(tmp_path / "bucket"), refresh_interval_s=0.05)
    await tier.open()
    assert await tier.wait_ready(30)
    calls = 0
    real = tier.refresh

    async def flaky(*a: object, **kw: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("need at least one array to concatenate")
        await real(*a, **kw)

    tier.refresh = flaky  # type: ignore[method-assign]
    try:
        for _ in range(200):
            if calls >= 3:
                break
            await asyncio.sleep(0.05)
        assert calls >= 3, f"refresh stopped after {calls} pass(es)"
        assert tier._refresher is not None and not tier._refresher.done()
        assert "object tier refresh failed" in caplog.text
    finally:
        await tier.close()
