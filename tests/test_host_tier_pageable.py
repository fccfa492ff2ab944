"""With CUDA KV caches only the staging slabs (the DMA sources) are pinned; the host tier's arena is not."""

from __future__ import annotations

import pytest
import torch

from dynamo_tiered_kv.blocks.keys import Namespace
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.staging import slabs as staging


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """CUDA reported present; every ``cudaHostRegister`` request recorded (and declined, so nothing
    later tries to unregister on a machine without CUDA)."""
    requests: list[tuple[int, int]] = []

    def register(addr: int, nbytes: int) -> bool:
        requests.append((addr, nbytes))
        return False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staging, "_cuda_host_register", register)
    return requests


def test_host_tier_arena_is_not_requested_pinned_on_cuda(fake_cuda: list[tuple[int, int]]) -> None:
    cfg = TieredKVConfig.from_mapping({"metrics_port": None, "host_capacity_bytes": 48 << 20,
                                       "staging_slab_bytes": 4 << 20, "staging_slabs": 2})
    ns = Namespace("m", "bf16", "FLASH_ATTN", 16, 2, 2, 64)
    store = build_store(cfg, ns)
    try:
        host = next(t for t in store.tiers if t.name == "host")
        asked = {addr for addr, _ in fake_cuda}
        assert host._arena.address not in asked  # memcpy'd to and from staging only: stays pageable
        assert not host._arena.pinned
        slabs = {s.address for s in store.staging.slabs}
        assert slabs and slabs <= asked  # the DMA sources are still requested pinned
    finally:
        store.close()
