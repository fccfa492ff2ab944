"""Tenants: ids, per-tenant quotas and encryption at rest with per-tenant keys (docs/ENCRYPTION.md)."""
