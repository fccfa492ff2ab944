"""A process that ends without closing its store still keeps every offload it accepted.

Each test runs a child process that builds a store through ``factory.build_store`` (host, SSD,
local-directory objects), submits offloads and returns from its last call at once: no
``close``. Python then stops its thread-pool executors before ``atexit`` handlers run, so the
store must drain, seal and hand over the flush from its own hook (``lifecycle``), in bounded time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.tiers.ssd.segment import list_segments, read_footer_at

NS = Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 4, 2, 64)
BLOCKS = 48  # three batches of 16, like the last chunks of a chunked prefill

CHILD = textwrap.dedent("""
    import atexit, json, sys
    import numpy as np, torch
    from dynamo_tiered_kv.config import TieredKVConfig
    from dynamo_tiered_kv.factory import build_store
    from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
    from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv

    def run(cfg, mode):
        ns = Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 4, 2, 64)
        ts = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=4, num_blocks=64, block_size=16,
                                num_kv_heads=2, head_size=64)
        g = torch.Generator().manual_seed(7)
        for t in ts:
            t.copy_(torch.randn(t.shape, generator=g))
        layout = EngineLayout(EngineLayoutKind.VLLM_CPU, ts, 16, 2, 64)
        store = build_store(TieredKVConfig.from_mapping(cfg), ns)
        if mode == "atexit":  # like an engine whose shutdown runs from atexit (in-process vLLM)
            atexit.register(store.close)
        keys = chain_keys(ns, np.arange(16 * 48))
        parents = parents_of(keys)
        for c in range(0, 48, 16):
            assert store.submit_offload(layout, list(range(c, c + 16)), keys[c:c + 16], parents[c:c + 16],
                                        first_index=c)
        # no close, no drain: the process ends right after its last offload

    cfg, mode = json.loads(sys.argv[1]), sys.argv[2]
    if mode == "worker_process":  # a multiprocessing child (vLLM's engine-core and worker processes)
        import multiprocessing
        p = multiprocessing.get_context("fork").Process(target=run, args=(cfg, mode))
        p.start()
        p.join()
        sys.exit(p.exitcode)
    run(cfg, mode)
""")


def _config(tmp_path: Path, **kw: object) -> dict:
    cfg = {
        "host_capacity_bytes": 8 << 20,
        "ssd_dir": str(tmp_path / "ssd"),
        "ssd_capacity_bytes": 64 << 20,
        "ssd_segment_bytes": 16 << 20,  # every block fits one open segment: only an exit seal seals it
        "ssd_seal_idle_s": 600.0,
        "ssd_io": "buffered",
        "object_url": f"file://{tmp_path / 'objects'}",
        "object_refresh_s": None,
        "staging_slab_bytes": 1 << 20,
        "staging_slabs": 8,
    }
    cfg.update(kw)
    return cfg


def _run_child(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DYN_TIERED_KV_METRICS_PORT", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(_config(tmp_path)), mode], env=env,
                          capture_output=True, text=True, timeout=240)
    return proc, time.monotonic() - t0


def _check_everything_kept(tmp_path: Path, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr
    assert "cannot schedule new futures" not in proc.stderr, proc.stderr
    assert "at close failed" not in proc.stderr, proc.stderr
    segs = list_segments(tmp_path / "ssd" / "rank-000")
    assert segs, "no SSD segment was written"
    entries = 0
    for _seq, path in segs:  # sealed by the exiting process, not repaired by the next one
        footer = read_footer_at(path, path.stat().st_size)
        assert footer is not None, f"{path.name} was left unsealed"
        entries += len(footer.entries)
    assert entries == BLOCKS
    # the next process finds (and verifies) every block; an unflushed sealed segment is resumed
    ts = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=4, num_blocks=64, block_size=16,
                            num_kv_heads=2, head_size=64)
    dst = EngineLayout(EngineLayoutKind.VLLM_CPU, ts, 16, 2, 64)
    keys = chain_keys(NS, np.arange(16 * BLOCKS))
    store = build_store(TieredKVConfig.from_mapping(_config(tmp_path)), NS)
    try:
        assert store.lookup(keys).num_blocks == BLOCKS
        res = store.load(dst, list(range(BLOCKS)), keys, timeout=60)
        assert res.failed_block_ids == [] and len(res.loaded_block_ids) == BLOCKS
        assert store._call(store.flusher.drain(30), timeout=40)
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["no_close", "atexit", "worker_process"])
def test_exit_without_close_keeps_every_accepted_offload(tmp_path: Path, mode: str) -> None:
    proc, seconds = _run_child(tmp_path, mode)
    _check_everything_kept(tmp_path, proc)
    assert seconds < 120


def test_close_all_closes_open_stores_once(tmp_path: Path) -> None:
    from dynamo_tiered_kv.store import lifecycle

    a = build_store(TieredKVConfig.from_mapping(_config(tmp_path / "a")), NS)
    b = build_store(TieredKVConfig.from_mapping(_config(tmp_path / "b")), NS)
    b.close()
    assert a in lifecycle._stores and b not in lifecycle._stores
    lifecycle.close_all()
    assert a.closed and a not in lifecycle._stores
    lifecycle.close_all()  # nothing left: a no-op
