"""G3 SSD tier: append-only segment files with O_DIRECT/io_uring I/O and crash recovery.

See ``tier.SSDTier`` and docs/SSD.md.
"""

from .tier import DEFAULT_SEGMENT_BYTES, SSDTier

__all__ = ["DEFAULT_SEGMENT_BYTES", "SSDTier"]
