"""The GPUDirect verdict is probed in the SSD tier's own directory, once per filesystem."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from dynamo_tiered_kv.tiers.ssd import SSDTier, gds_probe
from dynamo_tiered_kv.tiers.ssd.gds_probe import GdsVerdict, gds_verdict


@pytest.fixture
def probed(monkeypatch: pytest.MonkeyPatch) -> list[Path | None]:
    """A fresh verdict cache and a probe that records where it ran (no GPU needed)."""
    where: list[Path | None] = []

    def fake_probe(directory: Path | None = None, slab_bytes: int = 0) -> GdsVerdict:
        where.append(directory)
        return GdsVerdict(False, f"fake probe in {directory}", "none")

    monkeypatch.setattr(gds_probe, "_VERDICTS", {}, raising=False)
    monkeypatch.setattr(gds_probe, "_GDS", None, raising=False)
    monkeypatch.setattr(gds_probe, "probe_gds", fake_probe)
    return where


async def test_the_tier_probes_in_its_own_directory(tmp_path: Path, probed: list[Path | None]) -> None:
    t = SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, segment_bytes=256 << 10, idle_seal_s=None)
    await t.open()
    try:
        assert probed == [t.rank_dir]
        assert t.gds.reason == f"fake probe in {t.rank_dir}"
    finally:
        await t.close()


def test_one_probe_per_filesystem(tmp_path: Path, probed: list[Path | None]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    first = gds_verdict(a)
    assert gds_verdict(b) is first  # same filesystem: the verdict is reused
    assert probed == [a]
    other = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else None
    if other is None or os.stat(other).st_dev == os.stat(a).st_dev:
        pytest.skip("no second filesystem here")
    try:
        assert gds_verdict(other).reason == f"fake probe in {other}"
        assert probed == [a, other]
    finally:
        other.rmdir()
