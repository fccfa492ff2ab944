"""G4 object tier: S3 (aiobotocore) or a local directory, with manifests, GC and fsck."""

from .backend import BackendStats, FileSource, ObjectBackend, ObjectInfo
from .localdir import LocalDirBackend
from .manifest import Manifest, ManifestError
from .retry import CircuitBreaker, RetryPolicy
from .s3 import S3Backend
from .tier import ObjectTier, ObjectTierStats
from .urls import backend_from_url, is_object_url

__all__ = [
    "BackendStats",
    "CircuitBreaker",
    "FileSource",
    "LocalDirBackend",
    "Manifest",
    "ManifestError",
    "ObjectBackend",
    "ObjectInfo",
    "ObjectTier",
    "ObjectTierStats",
    "RetryPolicy",
    "S3Backend",
    "backend_from_url",
    "is_object_url",
]
