"""The retained share (``retain_max_share``) per tenant: one tenant's ``kv.retain`` flood neither
exceeds its own share nor makes another tenant's protections yield (policy/retention.py)."""

from __future__ import annotations

from dynamo_tiered_kv.policy.retention import RetentionClasses

REC = 1000


def _key(tenant: str, i: int) -> bytes:
    return f"{tenant}-{i}".encode().ljust(16, b".")


def test_a_flooders_protections_yield_before_another_tenants() -> None:
    cls = RetentionClasses(100 * REC, max_share=0.5, clock=lambda: 0.0)
    for i in range(5):  # alice: a few blocks at a modest priority
        assert cls.set(_key("alice", i), 10, None, REC, holder=("alice", "s1"))
    for i in range(200):  # the flooder retains everything at the top priority
        cls.set(_key("flood", i), 100, None, REC, holder=("flood", "x"))
    assert all(cls.protected(_key("alice", i)) for i in range(5)), "another tenant's hints pushed alice out"
    assert cls.protected_bytes <= cls.bound_bytes
    per = cls.tenant_protected_bytes()
    assert per["alice"] == 5 * REC and per["flood"] == 45 * REC


def test_a_tenant_cannot_exceed_its_share_of_its_own_limit() -> None:
    limits = {"small": 20 * REC}
    cls = RetentionClasses(100 * REC, max_share=0.5, clock=lambda: 0.0,
                           tenant_limit=lambda t: limits.get(t, 100 * REC))
    for i in range(30):
        cls.set(_key("small", i), 50 + i % 10, None, REC, holder=("small", None))
    assert cls.tenant_protected_bytes()["small"] == 10 * REC  # half of its 20-record limit
    kept = [i for i in range(30) if cls.protected(_key("small", i))]
    assert sorted(50 + i % 10 for i in kept) == [56, 57, 57, 57, 58, 58, 58, 59, 59, 59]  # its lowest yielded
    # a tenant without an explicit limit still has the tier's whole share
    for i in range(40):
        cls.set(_key("big", i), 5, None, REC, holder=("big", None))
    assert cls.tenant_protected_bytes()["big"] == 40 * REC


def test_one_tenant_keeps_the_old_order_lowest_priority_yields_first() -> None:
    cls = RetentionClasses(10 * REC, max_share=0.5, clock=lambda: 0.0)
    for i, p in enumerate([30, 10, 50, 20, 40, 60]):
        cls.set(_key("t", i), p, None, REC, holder=("t", None))
    assert not cls.protected(_key("t", 1))  # priority 10 went when the sixth arrived
    assert all(cls.protected(_key("t", i)) for i in (0, 2, 3, 4, 5))


def test_releasing_and_forgetting_keep_the_per_tenant_bytes_exact() -> None:
    cls = RetentionClasses(100 * REC, max_share=0.5, clock=lambda: 0.0)
    for i in range(4):
        cls.set(_key("a", i), 10, None, REC, holder=("a", None))
        cls.set(_key("b", i), 10, None, REC, holder=("b", None))
    cls.release([_key("a", 0)], ("a", None))
    cls.forget([_key("b", 1), _key("b", 2)])
    assert cls.tenant_protected_bytes() == {"a": 3 * REC, "b": 2 * REC}
    cls.set(_key("x", 0), 10, None, REC)  # anonymous holders share the tenant ""
    assert cls.tenant_protected_bytes()[""] == REC
