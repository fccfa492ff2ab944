"""Plain helpers for S3 tests (no fixtures, so test modules can import them freely)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    kind: str  # "moto" or "ceph"

    def backend_kwargs(self, **extra: object) -> dict[str, object]:
        return {"endpoint_url": self.endpoint, "access_key": self.access_key,
                "secret_key": self.secret_key, "create_bucket": True, **extra}

    def env(self) -> dict[str, str]:
        return {"DTKV_S3_ENDPOINT": self.endpoint, "DTKV_S3_ACCESS_KEY": self.access_key,
                "DTKV_S3_SECRET_KEY": self.secret_key}


def unique_bucket(tag: str = "t") -> str:
    return f"dtkv-{tag}-{uuid.uuid4().hex[:12]}"


async def proxied_store_settings(server: S3Server, endpoint: str, tag: str, **settings: object) -> dict[str, object]:
    """Settings of a store whose only tier is a new bucket on ``server`` reached at ``endpoint`` (a
    fault proxy in front of it): the bucket is made directly, nothing refreshes or expires in the
    background (a test counting requests or injecting faults sees only its own), 4 slabs of 1 MiB;
    ``settings`` add to or replace these."""
    from dynamo_tiered_kv.tiers.objectstore import S3Backend

    bucket = unique_bucket(tag)
    maker = S3Backend(bucket, **server.backend_kwargs())
    await maker.open()  # the bucket, made without the proxy
    await maker.close()
    return {"host_capacity_bytes": 0, "object_url": f"s3://{bucket}/kv", "object_refresh_s": None,
            "s3_endpoint_url": endpoint, "s3_access_key": server.access_key, "s3_secret_key": server.secret_key,
            "staging_slab_bytes": 1 << 20, "staging_slabs": 4, "expire_interval_s": 0, **settings}


def count_slab_takes(pool: object) -> list[int]:
    """Counts every staging slab ``pool`` (a ``StagingPool``) hands out from now on, in element 0."""
    seen = [0]
    real = pool.try_acquire  # type: ignore[attr-defined]

    def counting(timeout: float | None = 0.0):  # type: ignore[no-untyped-def]
        seen[0] += 1
        return real(timeout)

    pool.try_acquire = counting  # type: ignore[attr-defined]
    return seen
