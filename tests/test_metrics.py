"""Store metrics: per-store registries, capacity gauges, and the HTTP endpoint."""

from __future__ import annotations

import errno
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store import TieredStore
from dynamo_tiered_kv.store.metrics import StoreMetrics
from dynamo_tiered_kv.tiers.host import HostTier

NS = Namespace("tiny", "bfloat16", "VLLM_CPU", 16, 2, 2, 32)


def test_two_stores_have_independent_registries() -> None:
    a, b = StoreMetrics(), StoreMetrics()
    a.hits.labels("host").inc(3)
    assert a.value("tier_hits_total", tier="host") == 3
    assert b.value("tier_hits_total", tier="host") == 0


def test_capacity_gauges_and_http_endpoint() -> None:
    tensors = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=2, num_blocks=8, block_size=16,
                                 num_kv_heads=2, head_size=32)
    layout = EngineLayout(EngineLayoutKind.VLLM_CPU, tensors, 16, 2, 32)
    keys = chain_keys(NS, np.arange(48))
    pool = StagingPool(1 << 20, 2, pin=False)
    host = HostTier(4 << 20, chunk_bytes=64 << 10, pin=False)
    try:
        with TieredStore([host], NS, pool, metrics_port=0) as store:
            assert store.submit_offload(layout, [1, 2, 3], keys, parents_of(keys))
            store.drain(10)
            store.load(layout, [4, 5, 6], keys, timeout=10)
            assert store.metrics.value("tier_blocks", tier="host") == 3
            assert store.metrics.value("tier_capacity_bytes", tier="host") == 4 << 20
            assert store.metrics.value("tier_written_bytes_total", tier="host") == host.usage().used_bytes
            assert store.metrics_port
            with urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=10) as r:
                text = r.read().decode()
            for name in ("dtkv_tier_hits_total", "dtkv_tier_used_bytes", "dtkv_offload_dropped_total",
                         "dtkv_checksum_failures_total", "dtkv_tier_read_seconds_bucket"):
                assert name in text or name.replace("_total", "") in text, name
            assert 'dtkv_tier_hits_total{tier="host"} 3.0' in text
    finally:
        pool.close()


def _held_port() -> socket.socket:
    """A listening socket on a free port: what a previous worker still shutting down looks like."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    return s


def test_busy_metrics_port_never_stops_the_store() -> None:
    tensors = allocate_engine_kv(EngineLayoutKind.VLLM_CPU, num_layers=2, num_blocks=8, block_size=16,
                                 num_kv_heads=2, head_size=32)
    layout = EngineLayout(EngineLayoutKind.VLLM_CPU, tensors, 16, 2, 32)
    keys = chain_keys(NS, np.arange(48))
    pool = StagingPool(1 << 20, 2, pin=False)
    held = _held_port()
    busy = held.getsockname()[1]
    try:
        t0 = time.monotonic()
        with TieredStore([HostTier(4 << 20, chunk_bytes=64 << 10, pin=False)], NS, pool, metrics_port=busy) as store:
            assert time.monotonic() - t0 < 10  # retried briefly (about 2 s), not forever
            assert store.metrics_port not in (None, busy)  # the fallback port the log names
            assert store.metrics.value("observability_failures_total", what="port") == 1
            assert store.submit_offload(layout, [1, 2, 3], keys, parents_of(keys))
            store.drain(10)
            assert store.load(layout, [4, 5, 6], keys, timeout=10).failed_block_ids == []
            with urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=10) as r:
                assert 'dtkv_observability_failures_total{what="port"} 1.0' in r.read().decode()
    finally:
        held.close()
        pool.close()


def test_metrics_port_released_during_the_retry_is_used() -> None:
    held = _held_port()
    port = held.getsockname()[1]
    threading.Timer(0.3, held.close).start()
    m = StoreMetrics()
    try:
        assert m.serve(port, retry_s=5.0) == port
        assert m.value("observability_failures_total", what="port") == 0
    finally:
        m.close()
        held.close()


def test_no_bindable_port_serves_without_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_tiered_kv.store import metrics

    def refuse(port: int, **kw: object) -> None:
        raise OSError(errno.EADDRINUSE, "Address already in use")

    monkeypatch.setattr(metrics, "start_http_server", refuse)
    m = StoreMetrics()
    t0 = time.monotonic()
    assert m.serve(9, retry_s=0.3) is None
    assert time.monotonic() - t0 < 2
    assert m.value("observability_failures_total", what="port") == 1
    m.close()
