"""Prometheus metrics of one ``TieredStore``, per tier.

Every store gets its own ``CollectorRegistry`` (tests create many stores in one process, and
the default global registry refuses duplicate names). ``serve(port)`` exposes it over HTTP.

Names (all prefixed ``dtkv_``; ``tier`` is the tier's ``name``):

    tier_hits_total{tier}            blocks served (read and verified) from the tier
    tier_misses_total{tier}          blocks the tier was asked for and could not serve
    tier_read_bytes_total{tier}      bytes read from the tier
    tier_written_bytes_total{tier}   bytes written to the tier (offload, promotion)
    tier_read_seconds{tier}          latency of one batched read (histogram)
    tier_write_seconds{tier}         latency of one batched write (histogram)
    tier_errors_total{tier,op}       reads/writes that raised (tier down, full, I/O error)
    checksum_failures_total{tier}    records that failed verification (dropped, recomputed)
    tier_capacity_bytes{tier}        capacity bound          (gauges, read at scrape time)
    tier_used_bytes{tier}            bytes in use
    tier_blocks{tier}                blocks stored
    lookup_blocks_total{tier}        blocks found by lookup, by fastest tier ("none" = first miss)
    offload_blocks_total             blocks accepted for offload
    offload_dropped_total{reason}    offload batches dropped (queue_full, no_staging, too_large, closed)
    offload_inflight_skips_total{tier}  block saves skipped because a save of that block to that
                                     tier was still in flight (it stores the block)
    load_failed_blocks_total         blocks reported to the engine as failed loads
    restore_stage_seconds{stage,tier}  per load: stage "read" (tier = the tier; its read wall time),
                                     "wait" (caller blocked on reads), "decode" (verify+scatter),
                                     "paced" (verify+scatter held back by restore_cpu_share),
                                     "total" (the load call); tier "all" for the caller's stages
    restore_bytes_total{tier}        record bytes restores read from each tier
    restores_abandoned_total{reason} loads cut short by time, the rest recomputed: "estimate" (the
                                     object tier expected its GETs to outlast the restore budget and
                                     sent none), "budget" (the budget, recompute_tokens_per_s, ran
                                     out), "deadline" (the load's timeout passed), "stall" (a tier
                                     gave a read up: its source stayed silent past the tier's bound)
    observability_failures_total{what}  observability set-up that failed while the store kept serving
                                     (port: /metrics port unavailable; collector: not registered)
    codec_fast_path                  1 when the compiled codec helper is loaded, 0 when CPU-layout
                                     encode/decode runs on the slower Python path
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .._native import fast
from ..tiers.base import Tier

if TYPE_CHECKING:
    from .reads.stages import LoadStages

log = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _UsageCollector(Collector):
    """Reads ``Tier.usage()`` at scrape time, so the gauges are never stale."""

    def __init__(self, tiers: Callable[[], Sequence[Tier]]) -> None:
        self._tiers = tiers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        cap = GaugeMetricFamily("dtkv_tier_capacity_bytes", "capacity bound of the tier", labels=["tier"])
        used = GaugeMetricFamily("dtkv_tier_used_bytes", "bytes stored in the tier", labels=["tier"])
        blocks = GaugeMetricFamily("dtkv_tier_blocks", "blocks stored in the tier", labels=["tier"])
        ready = GaugeMetricFamily("dtkv_object_index_ready", "1 once the object tier's background index "
                                  "build finished (misses until then)", labels=["tier"])
        indexed = GaugeMetricFamily("dtkv_object_index_blocks", "blocks in the object tier's index", labels=["tier"])
        for t in self._tiers():
            try:
                u = t.usage()
            except Exception:  # a broken tier must not break the scrape
                continue
            cap.add_metric([t.name], u.capacity_bytes)
            used.add_metric([t.name], u.used_bytes)
            blocks.add_metric([t.name], u.num_blocks)
            if t.capabilities.medium == "object":  # the object tier indexes in the background
                ready.add_metric([t.name], float(t.index_ready))
                indexed.add_metric([t.name], u.num_blocks)
        yield from (cap, used, blocks, ready, indexed)


class StoreMetrics:
    """The counters and histograms a store updates; see the module docstring for names."""

    def __init__(self, tiers: Sequence[Tier] = (), registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.hits = Counter("dtkv_tier_hits", "blocks served from the tier", ["tier"], registry=r)
        self.misses = Counter("dtkv_tier_misses", "blocks the tier could not serve", ["tier"], registry=r)
        self.read_bytes = Counter("dtkv_tier_read_bytes", "bytes read from the tier", ["tier"], registry=r)
        self.written_bytes = Counter("dtkv_tier_written_bytes", "bytes written to the tier", ["tier"],
                                     registry=r)
        self.read_seconds = Histogram("dtkv_tier_read_seconds", "batched read latency", ["tier"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.write_seconds = Histogram("dtkv_tier_write_seconds", "batched write latency", ["tier"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.errors = Counter("dtkv_tier_errors", "tier operations that raised", ["tier", "op"], registry=r)
        self.checksum_failures = Counter("dtkv_checksum_failures", "records that failed verification",
                                         ["tier"], registry=r)
        self.lookup_blocks = Counter("dtkv_lookup_blocks", "blocks found by lookup, by fastest tier",
                                     ["tier"], registry=r)
        self.offload_blocks = Counter("dtkv_offload_blocks", "blocks accepted for offload", registry=r)
        self.offload_dropped = Counter("dtkv_offload_dropped", "offload batches dropped", ["reason"],
                                       registry=r)
        self.offload_inflight_skips = Counter("dtkv_offload_inflight_skips", "block saves skipped: a save of the "
                                              "block to that tier was in flight", ["tier"], registry=r)
        self.load_failed_blocks = Counter("dtkv_load_failed_blocks", "blocks reported as failed loads",
                                          registry=r)
        self.observability_failures = Counter("dtkv_observability_failures",
                                              "observability set-up failures the store served through", ["what"],
                                              registry=r)
        self.restore_stage_seconds = Histogram("dtkv_restore_stage_seconds", "time per load stage (read per tier, "
                                               "wait, decode, paced, total)", ["stage", "tier"],
                                               buckets=_LATENCY_BUCKETS, registry=r)
        self.restore_bytes = Counter("dtkv_restore_bytes", "record bytes restores read, by tier", ["tier"],
                                     registry=r)
        self.restores_abandoned = Counter("dtkv_restores_abandoned", "loads cut short by time (estimate, budget, "
                                          "deadline, stall); their blocks are recomputed", ["reason"], registry=r)
        self.codec_fast_path = Gauge("dtkv_codec_fast_path", "1 when the compiled codec helper is loaded",
                                     registry=r)
        self.codec_fast_path.set(float(fast.AVAILABLE))
        self._tiers = list(tiers)
        usage = _UsageCollector(lambda: self._tiers)
        r.register(usage)
        self._own = [self.hits, self.misses, self.read_bytes, self.written_bytes, self.read_seconds,
                     self.write_seconds, self.errors, self.checksum_failures, self.lookup_blocks,
                     self.offload_blocks, self.offload_dropped, self.offload_inflight_skips, self.load_failed_blocks,
                     self.observability_failures,
                     self.restore_stage_seconds, self.restore_bytes, self.restores_abandoned, self.codec_fast_path,
                     usage]
        self._server = None

    def observe_restore(self, st: LoadStages) -> None:
        """Record one load's stage timings (``TieredStore.load``)."""
        h = self.restore_stage_seconds
        for tier, sec in st.read_s.items():
            h.labels("read", tier).observe(sec)
        for tier, n in st.read_bytes.items():
            self.restore_bytes.labels(tier).inc(n)
        h.labels("wait", "all").observe(st.wait_s)
        h.labels("decode", "all").observe(st.decode_s)
        if st.paced_s:
            h.labels("paced", "all").observe(st.paced_s)
        h.labels("total", "all").observe(st.total_s)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (0.0 if never set). ``name`` without the ``dtkv_`` prefix."""
        full = f"dtkv_{name}"
        for collector in self._own:  # only ours: a broken collector added by others cannot break this
            for metric in collector.collect():
                for sample in metric.samples:
                    if sample.name in (full, f"{full}_total") and sample.labels == labels:
                        return float(sample.value)
        return 0.0

    def serve(self, port: int, addr: str = "0.0.0.0", *, retry_s: float = 2.0) -> int | None:
        """Serve ``/metrics`` on ``port`` (0 picks a free one). Returns the bound port, or None.

        Never raises: observability must not stop inference. A busy port is retried for
        ``retry_s`` (a restarted worker's predecessor may still hold it); then the endpoint moves
        to a free port, or is left off if even that fails, with one log line naming the outcome
        and ``dtkv_observability_failures_total{what="port"}`` counting it.
        """
        deadline = time.monotonic() + retry_s
        delay = 0.05
        while True:
            try:
                return self._bind(port, addr)
            except OSError as e:
                err: Exception = e
                if e.errno != errno.EADDRINUSE or time.monotonic() + delay > deadline:
                    break
            except Exception as e:  # e.g. OverflowError for a port out of range: not worth a retry
                err = e
                break
            time.sleep(delay)
            delay = min(2 * delay, 0.5)
        self.observability_failures.labels("port").inc()
        if port != 0:
            try:
                bound = self._bind(0, addr)
            except Exception as e:
                err = e
            else:
                log.warning("metrics port %d unavailable (%s); serving /metrics on fallback port %d instead",
                            port, err, bound)
                return bound
        log.warning("metrics endpoint unavailable (%s: %s); serving without /metrics", type(err).__name__, err)
        return None

    def _bind(self, port: int, addr: str) -> int:
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        bound = int(server.server_address[1])
        log.info("dtkv metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
