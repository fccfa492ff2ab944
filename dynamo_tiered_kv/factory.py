"""Build a ``TieredStore`` from a ``TieredKVConfig``: the one place that knows concrete tiers.

Tier order is fixed by speed: host (G2), SSD (G3), objects (G4); each is present only when
configured. The store itself writes host and SSD; the object tier is fed by the background
``Flusher`` from sealed SSD segments (or written directly when there is no SSD tier).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .blocks.codec import record_bytes
from .blocks.keys import Namespace
from .blocks.layout import BlockShape
from .config import TieredKVConfig
from .errors import ConfigError
from .log_setup import ensure_visible
from .policy.quotas import TenantQuotas
from .staging.device_slabs import DeviceStagingPool
from .staging.slabs import StagingPool
from .store import TieredStore
from .tenants.metrics import TenantCollector
from .tiers.base import Tier

if TYPE_CHECKING:
    from .tenants.kek import KeySource
    from .tiers.ssd.gds import DeviceIO

log = logging.getLogger(__name__)


class _FlusherTask:
    """Adapts the flusher's start/stop to the store's background-task protocol."""

    def __init__(self, flusher) -> None:  # flusher: dynamo_tiered_kv.tiers.objectstore.flush.Flusher
        self.flusher = flusher

    async def run(self) -> None:
        await self.flusher.start()

    async def stop(self) -> None:
        await self.flusher.stop()

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until every sealed segment is in the object tier (the store calls this on close)."""
        return await self.flusher.drain(timeout)

    def __repr__(self) -> str:
        return "flusher"


class _FlushCollector(Collector):
    """Flusher progress as Prometheus metrics (queue, lag, failures)."""

    def __init__(self, flusher) -> None:
        self.flusher = flusher

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self.flusher.stats
        yield GaugeMetricFamily("dtkv_flush_queue_segments", "sealed segments waiting for upload", s.queue_length)
        yield GaugeMetricFamily("dtkv_flush_in_flight_segments", "segments being uploaded", s.in_flight)
        yield GaugeMetricFamily("dtkv_flush_lag_bytes", "sealed SSD bytes not yet in the object tier", s.lag_bytes)
        yield GaugeMetricFamily("dtkv_flush_lag_seconds", "age of the oldest unflushed segment", s.lag_seconds)
        yield CounterMetricFamily("dtkv_flush_segments", "segments copied to the object tier", s.flushed_segments)
        yield CounterMetricFamily("dtkv_flush_bytes", "bytes copied to the object tier", s.flushed_bytes)
        yield CounterMetricFamily("dtkv_flush_failures", "failed upload attempts (retried)", s.failures)
        yield CounterMetricFamily("dtkv_flush_already_stored_segments",
                                  "sealed segments marked flushed without upload: the object tier held every record",
                                  s.already_stored_segments)
        yield CounterMetricFamily("dtkv_flush_already_stored_bytes", "bytes of those segments (uploads saved)",
                                  s.already_stored_bytes)


class _ObjectReadCollector(Collector):
    """The S3 backend's hedged GETs as Prometheus counters (read at scrape time)."""

    def __init__(self, backend) -> None:  # backend: dynamo_tiered_kv.tiers.objectstore.ObjectBackend
        self.backend = backend

    def collect(self) -> Iterable[CounterMetricFamily]:
        s = self.backend.stats
        yield CounterMetricFamily("dtkv_s3_hedges_sent", "second GETs sent for a range whose first GET was late "
                                  "to answer", s.hedges_sent)
        yield CounterMetricFamily("dtkv_s3_hedges_won", "ranged reads answered by their second GET", s.hedges_won)


class _ProcessWideMetrics(Collector):
    """Re-exports the ``dtkv_*`` metrics some tiers keep in prometheus' process-wide registry
    (the SSD tier's), so one ``/metrics`` endpoint per store shows everything."""

    def collect(self):
        from prometheus_client import REGISTRY

        try:
            for family in REGISTRY.collect():
                if family.name.startswith("dtkv_"):
                    yield family
        except Exception as e:  # someone else's broken collector must not break our scrape
            log.warning("process-wide metrics skipped in this scrape: %s", e)


def check_record_fits(config: TieredKVConfig, shape: BlockShape, unit: str) -> None:
    """Refuse at start a staging slab too small for one record of this model (an engine ``unit``:
    vLLM block, SGLang page): no save or restore could ever run."""
    need = record_bytes(shape)
    if need > config.staging_slab_bytes:
        raise ConfigError(f"staging_slab_bytes={config.staging_slab_bytes} cannot hold one {unit} record of this "
                          f"model ({need} bytes): set staging_slab_bytes to at least {need}")


def worker_rank(*, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, dp_rank: int = 0) -> int:
    """The one rank a worker process of a host is known by: its SSD directory (``rank-NNN``) and its
    metrics port offset. Unique over data x pipeline x tensor parallelism, data outermost."""
    return (dp_rank * pp_size + pp_rank) * tp_size + tp_rank


def tenant_quotas(config: TieredKVConfig, tier: str, capacity_bytes: int) -> TenantQuotas | None:
    """The per-tenant limits of one tier (``tenant_default_share``, ``tenant_quotas``); None when
    no tenant is limited below the capacity."""
    from .blocks.tenant import parse_tenant
    from .config.sizes import parse_size

    salt = config.tenant_salt.get_secret_value()
    limits: dict[bytes, int] = {}
    for name, per_tier in config.tenant_quotas.items():
        v = per_tier.get(tier)  # type: ignore[call-overload]
        if v is not None:
            limits[parse_tenant(name, deployment_salt=salt)] = (
                int(v * capacity_bytes) if isinstance(v, float) else parse_size(v))
    q = TenantQuotas(capacity_bytes, default_share=config.tenant_default_share, limits=limits)
    return q if q.enforced else None


def key_source(config: TieredKVConfig) -> KeySource:
    """The key-encryption keys ``encryption_keys`` names (``file://``, ``env:``, ``dir://``)."""
    from .tenants.kek import DEFAULT_ENV, KeySource

    where = config.encryption_keys or f"env:{DEFAULT_ENV}"
    if where.startswith("file://"):
        return KeySource.from_file(where[len("file://"):])
    if where.startswith("dir://"):
        return KeySource.from_dir(where[len("dir://"):])
    if where.startswith("env:"):
        return KeySource.from_env(where[len("env:"):])
    raise ConfigError(f"encryption_keys must start with file://, dir:// or env:, got {where.split(':')[0]!r}")


def _sealing(config: TieredKVConfig, key_objects: object) -> Callable[[Tier], Tier]:
    """How a tier is wrapped so its records are sealed at rest (``tenants.sealed_tier``); the
    identity when encryption is off."""
    if config.encryption != "on":
        return lambda tier: tier
    import asyncio

    from .tenants.cipher import RecordCipher
    from .tenants.keystore import TenantKeyStore
    from .tenants.sealed_tier import SealedTier

    keys = TenantKeyStore(key_objects, key_source(config), key_cache_s=config.encryption_key_cache_s)  # type: ignore[arg-type]

    def cipher() -> RecordCipher:  # built in the tier's open(), on the store's loop
        return RecordCipher(keys.lookup(asyncio.get_running_loop()))

    return lambda tier: SealedTier(tier, cipher)


def build_store(config: TieredKVConfig, namespace: Namespace, *, rank: int | None = None) -> TieredStore:
    """Construct tiers, staging, flusher and metrics from ``config`` (does I/O: opens tiers).

    ``rank`` names this process's SSD subdirectory and offsets its metrics port; it must be unique
    among the workers of a host (``worker_rank``). Default: the namespace's position in its
    pipeline stage and TP group (a caller with data parallelism passes ``worker_rank(dp_rank=...)``).
    """
    ensure_visible()  # the start-up lines below show under an engine that configures only its own logger
    if rank is None:
        rank = worker_rank(tp_rank=namespace.tp_rank, tp_size=namespace.tp_size, pp_rank=namespace.pp_rank,
                           pp_size=namespace.pp_size)
    tiers: list[Tier] = []
    ttls: list[float | None] = []
    if config.host_capacity_bytes:
        from .tiers.host import HostTier

        tiers.append(HostTier(config.host_capacity_bytes,
                              quotas=tenant_quotas(config, "host", config.host_capacity_bytes)))
        ttls.append(config.host_ttl_s)
    ssd = None
    gpu_direct = _gpu_direct(config) if config.ssd_dir is not None else None
    if config.ssd_dir is not None:
        from .tiers.ssd import SSDTier

        ssd = SSDTier(
            config.ssd_dir,
            capacity_bytes=config.ssd_capacity_bytes,
            segment_bytes=config.ssd_segment_bytes,
            rank=rank,
            io=config.ssd_io,
            # without an object tier nothing will ever flush: eviction must be allowed
            allow_evict_unflushed=config.ssd_allow_evict_unflushed if config.object_url else True,
            idle_seal_s=config.ssd_seal_idle_s,
            device_io=gpu_direct[0] if gpu_direct else None,
            namespace=namespace.digest,  # verifying reads check the full identity, not only the key
            quotas=tenant_quotas(config, "ssd", config.ssd_capacity_bytes),
        )
        tiers.append(ssd)
        ttls.append(config.ssd_ttl_s)
    background = []
    flusher = None
    key_bucket = None  # the bucket's root (tenant keys span namespaces)
    obj_backend = None
    if config.object_url:
        from .tiers.objectstore import ObjectTier, backend_from_url
        from .tiers.objectstore.flush import Flusher

        backend = backend_from_url(
            config.object_url,
            endpoint_url=config.s3_endpoint_url,
            region=config.s3_region,
            access_key=config.s3_access_key.get_secret_value() if config.s3_access_key else None,
            secret_key=config.s3_secret_key.get_secret_value() if config.s3_secret_key else None,
            **(_s3_tuning(config) if config.object_url.startswith("s3://") else {}),
        )
        obj_backend = backend
        key_bucket = backend
        obj = ObjectTier(
            backend,
            capacity_bytes=config.object_capacity_bytes,
            ttl_s=config.object_ttl_s,
            refresh_interval_s=config.object_refresh_s,
            max_concurrency=config.s3_read_concurrency,
            verify_reads=False,  # the store verifies every record it loads and counts failures per tier
            namespace=namespace.digest,  # the identity the tier checks when it verifies reads itself
            quotas=tenant_quotas(config, "object", config.object_capacity_bytes),
        )
        tiers.append(obj)
        ttls.append(None)  # object retention is the GC's job (dtkv gc), shared across nodes
        if ssd is not None:
            flusher = Flusher(ssd, obj, max_queue=config.flush_queue_segments)
            ssd.on_sealed = lambda _seg: flusher.notify()
            background.append(_FlusherTask(flusher))
    if not tiers:
        raise ValueError("no tier configured: set host_capacity_bytes, ssd_dir or object_url")
    if config.encryption == "on" and (key_bucket is not None or config.ssd_dir is not None):
        if key_bucket is None:  # SSD only: tenant keys live beside the segments, erased with them
            from pathlib import Path

            from .tiers.objectstore.localdir import LocalDirBackend

            key_objects: object = LocalDirBackend(Path(config.ssd_dir or ".") / "tenant-keys")
        else:  # in the bucket, so every node reads (and an erase destroys) the same keys
            key_objects = key_bucket
        seal = _sealing(config, key_objects)
        tiers = [t if t.capabilities.medium == "host" else seal(t) for t in tiers]
    staging = StagingPool(config.staging_slab_bytes, config.staging_slabs)
    store = TieredStore(
        tiers,
        namespace,
        staging,
        admission=config.admission,
        min_prefix_blocks=config.min_prefix_blocks,
        max_pending_offloads=config.max_pending_offloads,
        # host and SSD are written by the store; with a flusher the object tier is fed from SSD
        write_depth=len(tiers) if flusher is None else len(tiers) - 1,
        ttl_s=ttls,
        background=background,
        # every worker runs its own store in its own process: rank r serves on metrics_port + r
        metrics_port=config.metrics_port + rank if config.metrics_port else config.metrics_port,
        device_staging=gpu_direct[1] if gpu_direct else None,
        retain_max_share=config.retain_max_share,
        expire_interval_s=config.expire_interval_s,
    )
    # object-tier reads of a restore end when recomputing would be sooner (store.reads.pipeline)
    store.reader.recompute_tokens_per_s = config.recompute_tokens_per_s
    _observe(store, _ProcessWideMetrics())
    _observe(store, TenantCollector(lambda: store.tiers))  # per-tenant bytes, quotas, retained bytes
    if obj_backend is not None and (config.object_url or "").startswith("s3://"):
        _observe(store, _ObjectReadCollector(obj_backend))
    if flusher is not None:
        _observe(store, _FlushCollector(flusher))
    store.flusher = flusher  # type: ignore[attr-defined]
    log.info("%s", tier_summary(config))
    return store


def tier_summary(config: TieredKVConfig) -> str:
    """One line for the start-up log: what each tier will hold (capacity, retention) or why it is
    off, and for each value the setting it comes from, ``[name]`` when set, ``[default name]`` when not."""
    given = config.model_fields_set

    def why(name: str) -> str:
        return f"[{name}]" if name in given else f"[default {name}]"

    def off(name: str) -> str:
        return f"{name} set to {getattr(config, name)}" if name in given else f"{name} not set"

    def size(n: int) -> str:
        k = min(max((n.bit_length() - 1) // 10, 0), 4)
        return f"{n / 1024**k:.4g} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[k]}"

    def dur(seconds: float) -> str:
        unit = next((u for u in ((86400, "d"), (3600, "h"), (60, "min")) if seconds >= u[0] and not seconds % u[0]),
                    (1, "s"))
        return f"{seconds / unit[0]:g}{unit[1]}"

    c = config
    host = (f"host {size(c.host_capacity_bytes)} {why('host_capacity_bytes')} for {dur(c.host_ttl_s)} "
            f"{why('host_ttl_s')}" if c.host_capacity_bytes else f"host off: {off('host_capacity_bytes')}")
    ssd = (f"SSD {c.ssd_dir} {why('ssd_dir')} {size(c.ssd_capacity_bytes)} {why('ssd_capacity_bytes')} for "
           f"{dur(c.ssd_ttl_s)} {why('ssd_ttl_s')}" if c.ssd_dir is not None else f"SSD off: {off('ssd_dir')}")
    obj = (f"objects {c.object_url} {why('object_url')} up to {size(c.object_capacity_bytes)} "
           f"{why('object_capacity_bytes')}, expired by dtkv gc after {dur(c.object_ttl_s)} {why('object_ttl_s')}"
           if c.object_url else f"objects off: {off('object_url')}")
    return f"tiered KV store: {host}; {ssd}; {obj}"


def _observe(store: TieredStore, collector: Collector) -> None:
    """Add ``collector`` to the store's registry; a failure costs the metrics, never the store."""
    try:
        store.metrics.registry.register(collector)
    except Exception as e:
        store.metrics.observability_failures.labels("collector").inc()
        log.warning("metrics collector %s not registered (%s); the store runs without it", type(collector).__name__, e)


def _gpu_direct(config: TieredKVConfig) -> tuple[DeviceIO, DeviceStagingPool] | None:
    """GDS_MT agent and registered device slabs when ``ssd_gpu_direct`` is on and the probe passes.

    Without CUDA (a CPU engine) there is nothing to move GPU-direct and nothing is logged; with
    CUDA, a failed probe or setup is logged loudly once and the SSD tier uses host staging.
    """
    if config.ssd_gpu_direct == "off":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from .tiers.ssd.gds_probe import gds_verdict

    # a round trip of one staging slab in the SSD directory; logs, sets the gauge
    if not gds_verdict(config.ssd_dir, slab_bytes=config.staging_slab_bytes).available:
        return None
    try:  # pragma: no cover - GPU + GDS only
        from .tiers.ssd.gds import DeviceIO

        pool = DeviceStagingPool(config.staging_slab_bytes, config.gpu_staging_slabs, "cuda")
        dio = DeviceIO("GDS_MT")
        dio.register(pool.slabs)
    except Exception as e:  # pragma: no cover - GPU + GDS only
        log.warning("GPU-direct setup failed (%s: %s); the SSD tier uses host staging", type(e).__name__, e)
        return None
    log.info("GPU-direct SSD transfers on: %d device slabs of %d bytes", config.gpu_staging_slabs,
             config.staging_slab_bytes)  # pragma: no cover - GPU + GDS only
    return dio, pool  # pragma: no cover - GPU + GDS only


def _s3_tuning(config: TieredKVConfig) -> dict:
    return {
        "verify_tls": config.s3_verify_tls,
        "addressing_style": config.s3_addressing_style,
        "part_bytes": config.s3_part_bytes,
        "max_concurrency": config.s3_max_concurrency,
        "read_concurrency": config.s3_read_concurrency,  # sizes the connection pool for the tier's reads
        "direct_reads": config.s3_direct_reads,
        "first_byte_timeout_s": config.s3_first_byte_timeout_s,
        "hedge_reads": config.s3_hedge_reads,
    }
