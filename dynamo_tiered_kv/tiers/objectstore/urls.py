"""Build an object backend from a URL: ``file:///dir`` or ``s3://bucket/prefix``.

For S3 the endpoint and credentials come from keyword arguments or, when absent, from the
environment: ``DTKV_S3_ENDPOINT`` (else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``),
``DTKV_S3_ACCESS_KEY`` / ``DTKV_S3_SECRET_KEY`` (else the standard AWS credential chain) and
``DTKV_S3_REGION`` (else ``AWS_REGION``, else us-east-1).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlparse

from ...errors import ConfigError
from .backend import ObjectBackend
from .localdir import LocalDirBackend
from .s3 import S3Backend


def is_object_url(target: str) -> bool:
    return target.startswith(("s3://", "file://"))


def backend_from_url(url: str, **s3_kwargs: Any) -> ObjectBackend:
    """Backend for ``url``; ``s3_kwargs`` override the environment (S3Backend arguments)."""
    u = urlparse(url)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL must be file:///absolute/path, got {url!r}")
        return LocalDirBackend(unquote(u.path))
    if u.scheme == "s3":
        if not u.netloc:
            raise ConfigError(f"s3 URL needs a bucket: {url!r}")
        env = os.environ
        kw: dict[str, Any] = {
            "endpoint_url": env.get("DTKV_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL"),
            "region": env.get("DTKV_S3_REGION") or env.get("AWS_REGION") or "us-east-1",
        }
        if env.get("DTKV_S3_ACCESS_KEY") and env.get("DTKV_S3_SECRET_KEY"):
            kw["access_key"] = env["DTKV_S3_ACCESS_KEY"]
            kw["secret_key"] = env["DTKV_S3_SECRET_KEY"]
        kw.update({k: v for k, v in s3_kwargs.items() if v is not None})
        return S3Backend(u.netloc, u.path.lstrip("/"), **kw)
    raise ConfigError(f"unsupported object store URL {url!r} (use s3://bucket/prefix or file:///dir)")
