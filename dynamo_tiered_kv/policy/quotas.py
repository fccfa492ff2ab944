"""Per-tenant byte quotas of one tier, and the ledger of what each tenant holds there.

A tier with quotas admits a tenant's block only within the tenant's limit: a tenant at its limit
makes room by evicting its *own* least valuable blocks (the tier's usual order: expired, then
unprotected least recently used, then the lowest retention class), never another tenant's. When
the tier as a whole is full, tenants over their limit (a limit lowered at run time) are evicted
first; only when no tenant is over its limit does the tier's plain order pick the victim, which
can happen only if the limits add up to more than the capacity (an operator's choice to
overcommit, as with the default share of 1.0).

A limit is an explicit byte count for a tenant, or ``default_share`` of the tier's capacity for
every other tenant (1.0: no quota, the default). Limits come from the settings
(``tenant_default_share``, ``tenant_quotas``; ``config/settings.py``).

Threads: ``TenantQuotas`` is immutable. ``TenantLedger`` is changed only under the owning tier's
lock (it has none of its own); ``snapshot`` copies it for metrics and listings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..blocks.tenant import tenant_hex


@dataclass(frozen=True)
class TenantQuotas:
    """The byte limit of each tenant on one tier (module docstring)."""

    capacity_bytes: int
    default_share: float = 1.0
    limits: Mapping[bytes, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if not 0.0 < self.default_share <= 1.0:
            raise ValueError(f"default_share must be in (0, 1], got {self.default_share}")
        for t, n in self.limits.items():
            if len(t) != 8 or n < 0:
                raise ValueError(f"tenant {t!r}: limits are non-negative byte counts of 8-byte tenant ids")

    @property
    def enforced(self) -> bool:
        """Whether any tenant can be refused before the tier is full."""
        return self.default_share < 1.0 or any(n < self.capacity_bytes for n in self.limits.values())

    def limit(self, tenant: bytes) -> int:
        explicit = self.limits.get(tenant)
        if explicit is not None:
            return min(explicit, self.capacity_bytes)
        return int(self.capacity_bytes * self.default_share)

    def describe(self) -> dict[str, int]:
        """Explicit limits by tenant (hex), for listings."""
        return {tenant_hex(t): self.limit(t) for t in self.limits}


class TenantLedger:
    """Bytes and blocks each tenant holds in one tier (changed under the tier's lock)."""

    __slots__ = ("_blocks", "_bytes")

    def __init__(self) -> None:
        self._bytes: dict[bytes, int] = {}
        self._blocks: dict[bytes, int] = {}

    def add(self, tenant: bytes, nbytes: int) -> None:
        self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
        self._blocks[tenant] = self._blocks.get(tenant, 0) + 1

    def remove(self, tenant: bytes, nbytes: int) -> None:
        left = self._blocks.get(tenant, 0) - 1
        if left <= 0:
            self._bytes.pop(tenant, None)
            self._blocks.pop(tenant, None)
            return
        self._blocks[tenant] = left
        self._bytes[tenant] -= nbytes

    def bytes_of(self, tenant: bytes) -> int:
        return self._bytes.get(tenant, 0)

    def over(self, quotas: TenantQuotas) -> list[bytes]:
        """Tenants holding more than their limit, most over first."""
        out = [(n - quotas.limit(t), t) for t, n in self._bytes.items() if n > quotas.limit(t)]
        return [t for _, t in sorted(out, reverse=True)]

    def snapshot(self) -> dict[bytes, tuple[int, int]]:
        """tenant -> (bytes, blocks), a copy."""
        return {t: (n, self._blocks[t]) for t, n in self._bytes.items()}

    def clear(self) -> None:
        self._bytes.clear()
        self._blocks.clear()


def holder_limit(quotas: TenantQuotas | None, tenant: str, capacity_bytes: int) -> int:
    """``Tier.tenant_limit``: the limit of ``tenant`` named as hint holders name it (hex), on a tier
    of ``capacity_bytes`` with ``quotas`` (None: the capacity). A holder that names no tenant id
    has the default share."""
    if quotas is None:
        return capacity_bytes
    try:
        return quotas.limit(bytes.fromhex(tenant))
    except ValueError:
        return quotas.limit(b"")
