"""Tenants in the SSD tier: what each tenant holds, what it is charged, and its quota.

Every index entry names its record's tenant (the record header's tenant field, read when the
record is written or recovered). ``TenantAccounts`` keeps, under the state's lock:

* the ledger (``policy.quotas.TenantLedger``): live records per tenant, bytes and blocks, exact
  through writes, overwrites, deletes, reclaim, eviction, expiry and recovery
  (``SSDTier.tenant_usage``);
* per segment, the live bytes of each tenant in it (``SegmentState.tenants``) and its owner
  (the tenant it was opened for);
* each tenant's *charge*: its share of the capacity budget, which counts segment files
  (docs/SSD.md section 8). A segment's size is split between the tenants whose live records lie
  in it, each charged its records' bytes, and its owner, charged the rest (footer, dead records
  not yet unlinked, the open segment's footer reserved ahead). The charges add up to the tier's
  used bytes exactly.

With quotas (``TenantQuotas.enforced``) segments hold one tenant each (the writer seals the open
segment before a record of another tenant), so a segment's whole size is its owner's charge and
evicting it takes blocks of that tenant only. The quota and the eviction rule built on these
numbers are ``Evictor.make_room``'s (the guarantee: docs/SSD.md section 8).

Threads: every method named ``*_locked`` is called with ``SegmentLogState.lock`` held (by the
writer thread, or a reader dropping a corrupt record); ``snapshot`` takes a copy under it.
"""

from __future__ import annotations

from typing import Protocol

from ...policy.quotas import TenantLedger, TenantQuotas


class SegmentState(Protocol):
    """What the accounts read and keep of a segment (``state.SegmentState``)."""

    seq: int
    size: int
    owner: bytes
    tenants: dict[bytes, int]
    live_bytes: int


class TenantAccounts:
    """The ledger, per-segment tenant bytes and charges of one rank directory (module docstring)."""

    def __init__(self, quotas: TenantQuotas | None) -> None:
        self.ledger = TenantLedger()
        #: the limits, when any tenant is limited below the capacity (None: no quota)
        self.quotas = quotas if quotas is not None and quotas.enforced else None
        self._segs_of: dict[bytes, dict[int, SegmentState]] = {}  # tenant -> segments it owns or has records in

    @property
    def one_tenant_segments(self) -> bool:
        """Whether each segment holds records of one tenant only (with quotas)."""
        return self.quotas is not None

    def limit(self, tenant: bytes) -> int | None:
        """The tenant's byte limit; None without quotas."""
        return None if self.quotas is None else self.quotas.limit(tenant)

    # --- changes (under the state's lock) ---------------------------------------------------
    def segment_added_locked(self, seg: SegmentState, owner: bytes) -> None:
        """``seg`` joined the tier, opened for (or first holding records of) ``owner``."""
        seg.owner = owner
        self._segs_of.setdefault(owner, {})[seg.seq] = seg

    def reown_locked(self, seg: SegmentState, owner: bytes) -> None:
        """The open segment, still without records, is given to another tenant."""
        assert seg.live_bytes == 0 and not seg.tenants
        self._forget(seg.owner, seg)
        self.segment_added_locked(seg, owner)

    def record_added_locked(self, seg: SegmentState, tenant: bytes, nbytes: int) -> None:
        self.ledger.add(tenant, nbytes)
        seg.tenants[tenant] = seg.tenants.get(tenant, 0) + nbytes
        seg.live_bytes += nbytes
        self._segs_of.setdefault(tenant, {})[seg.seq] = seg

    def record_removed_locked(self, seg: SegmentState | None, tenant: bytes, nbytes: int) -> None:
        self.ledger.remove(tenant, nbytes)
        if seg is None:
            return
        left = seg.tenants.get(tenant, 0) - nbytes
        seg.live_bytes -= nbytes
        if left > 0:
            seg.tenants[tenant] = left
            return
        seg.tenants.pop(tenant, None)
        if tenant != seg.owner:
            self._forget(tenant, seg)

    def segment_removed_locked(self, seg: SegmentState) -> None:
        """``seg`` left the tier (its live records were removed first)."""
        for tenant in [*seg.tenants, seg.owner]:
            self._forget(tenant, seg)

    def clear(self) -> None:
        self.ledger.clear()
        self._segs_of.clear()

    def _forget(self, tenant: bytes, seg: SegmentState) -> None:
        segs = self._segs_of.get(tenant)
        if segs is not None:
            segs.pop(seg.seq, None)
            if not segs:
                del self._segs_of[tenant]

    # --- questions (under the state's lock) -------------------------------------------------
    def segments_of_locked(self, tenant: bytes) -> list[SegmentState]:
        """The segments ``tenant`` owns or holds records in."""
        return list(self._segs_of.get(tenant, {}).values())

    def charge_locked(self, tenant: bytes) -> int:
        """Bytes of the capacity budget charged to ``tenant`` (module docstring)."""
        return sum(_charged(seg, tenant) for seg in self._segs_of.get(tenant, {}).values())

    def charges_locked(self) -> dict[bytes, int]:
        """Every tenant's charge."""
        return {t: sum(_charged(seg, t) for seg in segs.values()) for t, segs in self._segs_of.items()}

    def over_locked(self) -> set[bytes]:
        """Tenants charged more than their limit (none without quotas)."""
        q = self.quotas
        if q is None:
            return set()
        return {t for t, n in self.charges_locked().items() if n > q.limit(t)}

    def snapshot(self) -> dict[bytes, tuple[int, int]]:
        """tenant -> (live record bytes, blocks); the caller holds the state's lock."""
        return self.ledger.snapshot()


def _charged(seg: SegmentState, tenant: bytes) -> int:
    own = seg.size - seg.live_bytes if seg.owner == tenant else 0
    return seg.tenants.get(tenant, 0) + own

