"""One error root for the package; each class names the recovery it needs.

TieredKVError
├── ConfigError(ValueError)            refuse to start; message names the field
├── RecordError                        bytes of a stored block are unusable: drop them, count, recompute
│   ├── RecordTruncated                fewer bytes than the header promises
│   ├── BadMagic                       not a record at all (or a wrong offset)
│   ├── UnsupportedVersion             written by a newer format we cannot read
│   ├── HeaderCorrupt                  header checksum mismatch
│   ├── ChecksumMismatch               payload (a layer) checksum mismatch
│   ├── NamespaceMismatch              another model/layout/tenant wrote it
│   ├── KeyMismatch                    the index pointed at another block
│   ├── LayoutMismatch                 the record's shape does not fit the engine's layout
│   └── RecordSealed                   encrypted for its tenant and read without the key: a miss, keep it
├── TierUnavailable                    a tier is down or disabled: fail open, treat as a miss
│   └── PartialWrite                   a batch stopped partway: its first ``written`` items are stored
├── TierFull                           capacity bound would be exceeded and nothing is evictable
└── StagingExhausted                   no staging slab free within the timeout: drop the offload
"""

from __future__ import annotations


class TieredKVError(Exception):
    """Root of every error raised on purpose by dynamo_tiered_kv."""


class ConfigError(TieredKVError, ValueError):
    """Invalid configuration; the message names the offending field."""


class RecordError(TieredKVError):
    """Stored block bytes failed verification. Never serve them; treat the block as a miss."""


class RecordTruncated(RecordError):
    pass


class BadMagic(RecordError):
    pass


class UnsupportedVersion(RecordError):
    pass


class HeaderCorrupt(RecordError):
    pass


class ChecksumMismatch(RecordError):
    pass


class NamespaceMismatch(RecordError):
    pass


class KeyMismatch(RecordError):
    pass


class LayoutMismatch(RecordError):
    pass


class TierUnavailable(TieredKVError):
    """The tier cannot serve right now (disabled, down, out of space). Callers fall back."""


class SourceStalled(TierUnavailable):
    """A tier gave a read up because its source went silent past the tier's bound (a stalled
    gateway or device): another attempt would only wait too. The blocks are recomputed; the store
    counts the load as abandoned for a stall."""


def stalled_read(e: BaseException | None) -> bool:
    """Whether ``e``, or an error it was raised from (a retry layer wraps what it gives up on), is a
    ``SourceStalled``."""
    while e is not None:
        if isinstance(e, SourceStalled):
            return True
        e = e.__cause__
    return False


class TierFull(TieredKVError):
    """The write would exceed the tier's capacity and nothing can be evicted."""


class StagingExhausted(TieredKVError):
    """No staging slab became free in time; the caller drops the transfer and counts it."""


class PartialWrite(TierUnavailable):
    """A batch write stopped partway: its first ``written`` items ARE stored (durable, readable,
    indexed) and the rest are not. Callers account the stored prefix as written."""

    def __init__(self, message: str, *, written: int) -> None:
        super().__init__(message)
        self.written = written


class RecordSealed(RecordError):
    """A sealed (encrypted) record reached a reader that does not open it (encryption off here, or
    its tenant's key unavailable). A miss like any record error, but the record is intact: never
    delete or quarantine it for this."""
