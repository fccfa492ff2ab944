"""Per-tenant Prometheus gauges with bounded cardinality, read from the tiers at scrape time.

Families (labels ``tier``, ``tenant``; ``tenant`` is the id as ``blocks.tenant.tenant_hex`` writes
it, 16 hex digits, or ``other``):

* ``dtkv_tenant_bytes``: record bytes the tenant holds in the tier (``Tier.tenant_usage``);
* ``dtkv_tenant_blocks``: blocks the tenant holds in the tier (same snapshot as the bytes);
* ``dtkv_tenant_quota_bytes``: the bytes the tenant may hold there (``Tier.tenant_limit``: its
  quota, or the tier's capacity on a tier without quotas);
* ``dtkv_tenant_retained_bytes``: bytes the tier's retention table protects for the tenant
  (``RetentionClasses.tenant_protected_bytes``).

Cardinality: per tier, the ``top_n`` tenants holding the most bytes get their own series (ties by
tenant id, so equal tenants do not swap places between scrapes); every other tenant is summed
into one ``tenant="other"`` series of bytes, blocks and retained bytes, so the sum over a tier's
series is the tier's total. Protections held by no tenant (callers without hints) count in
``other`` as well. ``other`` has no quota series: a sum of limits is no tenant's limit. A tier
therefore exports at most ``top_n + 1`` series per family, however many tenants it holds.

A scrape costs O(T log top_n) for T tenants and never raises: a tier that does not account by
tenant (``tenant_usage`` is None) is left out, and a tier whose accounting raises is left out of
that scrape (logged once per tier) while the other tiers are served.

Threads: ``collect`` runs on the scrape thread (the metrics HTTP server's). It only calls the
tiers' copy-returning accessors, which take the tiers' own locks; the collector keeps no state
besides the names of tiers it has warned about.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..blocks.tenant import tenant_hex

if TYPE_CHECKING:
    from ..tiers.base import Tier

log = logging.getLogger(__name__)

#: tenants per tier with their own series; the rest are summed into ``tenant="other"``
DEFAULT_TOP_TENANTS = 20
OTHER = "other"
_LABELS = ["tier", "tenant"]


class TenantCollector(Collector):
    """``dtkv_tenant_*`` gauges of the tiers ``tiers()`` returns (module docstring)."""

    def __init__(self, tiers: Callable[[], Sequence[Tier]], top_n: int = DEFAULT_TOP_TENANTS) -> None:
        if top_n < 1:
            raise ValueError(f"top_n must be at least 1, got {top_n}")
        self._tiers = tiers
        self.top_n = top_n
        self._warned: set[str] = set()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        held = GaugeMetricFamily("dtkv_tenant_bytes", "record bytes a tenant holds in the tier (top tenants by "
                                 "bytes; tenant=\"other\" sums the rest)", labels=_LABELS)
        blocks = GaugeMetricFamily("dtkv_tenant_blocks", "blocks a tenant holds in the tier (top tenants by "
                                   "bytes; tenant=\"other\" sums the rest)", labels=_LABELS)
        quota = GaugeMetricFamily("dtkv_tenant_quota_bytes", "bytes a tenant may hold in the tier: its quota, "
                                  "else the tier's capacity (top tenants by bytes)", labels=_LABELS)
        retained = GaugeMetricFamily("dtkv_tenant_retained_bytes", "bytes the tier's retention protects for a "
                                     "tenant (top tenants by bytes; tenant=\"other\" sums the rest)", labels=_LABELS)
        try:
            tiers = list(self._tiers())
        except Exception as e:  # no tiers to read: empty families, never a failed scrape
            self._warn_once("<tiers>", e)
            tiers = []
        for tier in tiers:
            try:
                rows = self._rows(tier)
            except Exception as e:  # a broken tier costs its own series, not the scrape
                self._warn_once(str(getattr(tier, "name", type(tier).__name__)), e)
                continue
            if rows is None:
                continue
            for tenant, (nbytes, nblocks, limit, protected) in rows.items():
                held.add_metric([tier.name, tenant], nbytes)
                blocks.add_metric([tier.name, tenant], nblocks)
                retained.add_metric([tier.name, tenant], protected)
                if limit is not None:
                    quota.add_metric([tier.name, tenant], limit)
        yield from (held, blocks, quota, retained)

    def _rows(self, tier: Tier) -> dict[str, tuple[int, int, int | None, int]] | None:
        """tenant label -> (bytes, blocks, limit, retained bytes) of one tier; None: the tier does
        not account by tenant. Everything is read before anything is returned, so a tier that
        raises half way contributes nothing."""
        usage = tier.tenant_usage()
        if usage is None:
            return None
        protected = dict(tier.retention.tenant_protected_bytes())
        top = heapq.nsmallest(self.top_n, usage.items(), key=lambda kv: (-kv[1][0], kv[0]))
        rows: dict[str, tuple[int, int, int | None, int]] = {}
        for tenant, (nbytes, nblocks) in top:
            name = tenant_hex(tenant)
            rows[name] = (nbytes, nblocks, tier.tenant_limit(name), protected.pop(name, 0))
        shown = {t for t, _ in top}
        rest_bytes = rest_blocks = 0
        for tenant, (nbytes, nblocks) in usage.items():
            if tenant not in shown:
                rest_bytes += nbytes
                rest_blocks += nblocks
        # what is left in ``protected``: tenants outside the top, and protections of no tenant
        rows[OTHER] = (rest_bytes, rest_blocks, None, sum(protected.values()))
        return rows

    def _warn_once(self, what: str, error: Exception) -> None:
        if what in self._warned:
            log.debug("tenant metrics of %s skipped in this scrape: %s", what, error)
            return
        self._warned.add(what)
        log.warning("tenant metrics of %s skipped in this scrape (%s: %s); later failures are logged at debug",
                    what, type(error).__name__, error)
