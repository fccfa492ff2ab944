"""Per-tenant Prometheus gauges (tenants/metrics.py): the top tenants by bytes get their own
series and one ``tenant="other"`` series sums the rest exactly, so a tier exports a bounded number
of series however many tenants it holds; values are the tiers' own accounting; a tier that fails
or does not account by tenant never breaks a scrape; build_store registers the collector."""

from __future__ import annotations

from collections import defaultdict

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_tiered_kv.blocks.keys import Namespace
from dynamo_tiered_kv.blocks.tenant import DEFAULT_TENANT, tenant_hex, tenant_id
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.policy.quotas import TenantQuotas
from dynamo_tiered_kv.tenants.metrics import DEFAULT_TOP_TENANTS, OTHER, TenantCollector
from dynamo_tiered_kv.testing.records import make_record
from dynamo_tiered_kv.tiers.host import HostTier

REC = len(make_record(b"k" * 16))
FAMILIES = ("dtkv_tenant_bytes", "dtkv_tenant_blocks", "dtkv_tenant_quota_bytes", "dtkv_tenant_retained_bytes")
TENANTS = [tenant_id(f"tenant-{i}", deployment_salt="m") for i in range(100)]


def _key(tenant: bytes, i: int) -> bytes:
    return tenant + i.to_bytes(8, "little")


def _write(tier: HostTier, tenant: bytes, i: int) -> None:
    tier.write_sync(_key(tenant, i), memoryview(make_record(_key(tenant, i), i, tenant=tenant)))


def _scrape(registry: CollectorRegistry) -> dict[str, dict[tuple[str, str], float]]:
    """family -> {(tier, tenant): value}, parsed from the exposition text a scrape serves."""
    out: dict[str, dict[tuple[str, str], float]] = {f: {} for f in FAMILIES}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        if fam.name in out:
            for s in fam.samples:
                key = (s.labels["tier"], s.labels["tenant"])
                assert key not in out[fam.name], f"{fam.name}{key} exported twice"
                out[fam.name][key] = s.value
    return out


def _registry(collector: TenantCollector) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(collector)
    return r


@pytest.fixture
def crowded() -> tuple[HostTier, dict[bytes, int]]:
    """A host tier with quotas holding 100 tenants, tenant i with (i % 7) + 1 blocks; every
    tenant's first block is retained (holders named by tenant id, as the hint layer names them),
    plus one protection held by no tenant."""
    tier = HostTier(800 * REC, chunk_bytes=4096,
                    quotas=TenantQuotas(800 * REC, default_share=0.5, limits={TENANTS[6]: 40 * REC}))
    retention = tier.configure_retention(max_share=1.0, clock=lambda: 0.0)
    blocks = {}
    for i, t in enumerate(TENANTS):
        blocks[t] = i % 7 + 1
        for j in range(blocks[t]):
            _write(tier, t, j)
        assert retention.set(_key(t, 0), 10, None, REC, holder=(tenant_hex(t), None))
    _write(tier, DEFAULT_TENANT, 0)
    blocks[DEFAULT_TENANT] = 1
    assert retention.set(_key(DEFAULT_TENANT, 0), 10, None, REC)  # anonymous holder: no tenant
    return tier, blocks


def test_cardinality_stays_top_n_plus_other_with_100_tenants(crowded) -> None:
    tier, _ = crowded
    got = _scrape(_registry(TenantCollector(lambda: [tier])))
    for fam in ("dtkv_tenant_bytes", "dtkv_tenant_blocks", "dtkv_tenant_retained_bytes"):
        assert len(got[fam]) == DEFAULT_TOP_TENANTS + 1, fam
        assert ("host", OTHER) in got[fam]
    # a quota is a tenant's own: "other" has none
    assert len(got["dtkv_tenant_quota_bytes"]) == DEFAULT_TOP_TENANTS
    assert ("host", OTHER) not in got["dtkv_tenant_quota_bytes"]
    small = _scrape(_registry(TenantCollector(lambda: [tier], top_n=5)))
    assert {len(v) for f, v in small.items() if f != "dtkv_tenant_quota_bytes"} == {6}


def test_top_tenants_are_the_largest_and_other_sums_the_rest_exactly(crowded) -> None:
    tier, blocks = crowded
    usage = tier.tenant_usage()
    got = _scrape(_registry(TenantCollector(lambda: [tier])))
    shown = {bytes.fromhex(t) for (_, t) in got["dtkv_tenant_bytes"] if t != OTHER}
    # the 20 largest (7 blocks: 14 tenants, 6 blocks: the 6 lowest ids of 14), ties by id
    expected = sorted(usage, key=lambda t: (-usage[t][0], t))[:DEFAULT_TOP_TENANTS]
    assert shown == set(expected)
    rest = [t for t in usage if t not in shown]
    assert got["dtkv_tenant_bytes"][("host", OTHER)] == sum(usage[t][0] for t in rest)
    assert got["dtkv_tenant_blocks"][("host", OTHER)] == sum(usage[t][1] for t in rest) == sum(
        blocks[t] for t in rest)
    # every series of a family adds up to the tier's totals
    assert sum(got["dtkv_tenant_bytes"].values()) == tier.usage().used_bytes == sum(blocks.values()) * REC
    assert sum(got["dtkv_tenant_blocks"].values()) == tier.usage().num_blocks
    protected = tier.retention.tenant_protected_bytes()
    assert sum(got["dtkv_tenant_retained_bytes"].values()) == sum(protected.values()) == 101 * REC
    # the rest's protections, and the one no tenant holds, are "other"'s
    assert got["dtkv_tenant_retained_bytes"][("host", OTHER)] == (len(rest) - 1) * REC + REC


def test_values_match_the_tiers_accounting(crowded) -> None:
    tier, _ = crowded
    usage = tier.tenant_usage()
    protected = tier.retention.tenant_protected_bytes()
    got = _scrape(_registry(TenantCollector(lambda: [tier])))
    for (_, t), value in got["dtkv_tenant_bytes"].items():
        if t == OTHER:
            continue
        tenant = bytes.fromhex(t)
        assert value == usage[tenant][0]
        assert got["dtkv_tenant_blocks"][("host", t)] == usage[tenant][1]
        assert got["dtkv_tenant_quota_bytes"][("host", t)] == tier.tenant_limit(t)
        assert got["dtkv_tenant_retained_bytes"][("host", t)] == protected.get(t, 0)
    # the explicit quota and the default share both show
    assert got["dtkv_tenant_quota_bytes"][("host", tenant_hex(TENANTS[6]))] == 40 * REC
    assert got["dtkv_tenant_quota_bytes"][("host", tenant_hex(TENANTS[13]))] == 400 * REC


class _BrokenTier(HostTier):
    """A tier whose tenant accounting raises (a bug, a lock-order problem)."""

    name = "broken"

    def tenant_usage(self) -> dict[bytes, tuple[int, int]]:
        raise RuntimeError("accounting unavailable")


class _HalfBrokenTier(HostTier):
    """Usage works, the limit raises half way: the tier must contribute no partial set of series."""

    name = "half"

    def tenant_limit(self, tenant: str) -> int:
        raise OSError("limit unavailable")


class _UnaccountedTier(HostTier):
    """A tier that does not account by tenant (as the object tier may not)."""

    name = "unaccounted"

    def tenant_usage(self) -> None:  # type: ignore[override]
        return None


def test_a_failing_tier_does_not_break_the_scrape(crowded, caplog: pytest.LogCaptureFixture) -> None:
    tier, _ = crowded
    half = _HalfBrokenTier(10 * REC, chunk_bytes=4096)
    _write(half, TENANTS[0], 0)
    tiers = [_BrokenTier(10 * REC), half, _UnaccountedTier(10 * REC), tier]
    registry = _registry(TenantCollector(lambda: tiers))
    for _ in range(2):  # warned once per tier, served every time
        got = _scrape(registry)
        for fam, series in got.items():
            assert {tier_name for tier_name, _ in series} == {"host"}, fam
        assert len(got["dtkv_tenant_bytes"]) == DEFAULT_TOP_TENANTS + 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([w for w in warnings if "broken" in w]) == 1 and len([w for w in warnings if "half" in w]) == 1

    def no_tiers() -> list[HostTier]:
        raise RuntimeError("store closed")

    assert all(not v for v in _scrape(_registry(TenantCollector(no_tiers))).values())


def test_top_n_must_be_positive() -> None:
    with pytest.raises(ValueError, match="top_n"):
        TenantCollector(lambda: [], top_n=0)


def test_build_store_serves_tenant_metrics(tmp_path) -> None:
    """The store's /metrics registry carries the tenant families, with the host tier's tenants."""
    cfg = TieredKVConfig.from_mapping({"host_capacity_bytes": 64 << 20, "staging_slab_bytes": 1 << 20,
                                       "staging_slabs": 2, "tenant_default_share": 0.25})
    store = build_store(cfg, Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64))
    try:
        host = store.tiers[0]
        assert isinstance(host, HostTier)
        for j in range(3):
            _write(host, TENANTS[1], j)
        _write(host, TENANTS[2], 0)
        got = _scrape(store.metrics.registry)
        per_tenant: dict[str, float] = defaultdict(float)
        for (tier_name, t), v in got["dtkv_tenant_bytes"].items():
            assert tier_name == "host"
            per_tenant[t] += v
        assert per_tenant == {tenant_hex(TENANTS[1]): 3 * REC, tenant_hex(TENANTS[2]): REC, OTHER: 0}
        assert got["dtkv_tenant_quota_bytes"][("host", tenant_hex(TENANTS[1]))] == 16 << 20  # a quarter of the tier
    finally:
        store.close()
