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
