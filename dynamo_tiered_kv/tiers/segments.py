"""What the SSD tier hands the object tier: sealed, immutable segment files and their index.

The SSD tier implements ``SegmentSource``; the flusher consumes it. A sealed segment's bytes
are final (records + footer), so the object tier can upload the file as one object and restore
any record with a ranged GET at the entry's offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..blocks.keys import BlockKey
from ..blocks.tenant import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    key: BlockKey
    offset: int  # byte offset of the record inside the segment (4 KiB aligned)
    length: int  # record length (4 KiB multiple)
    tenant: bytes = DEFAULT_TENANT  # the record's tenant (``blocks.tenant``; its header names it too)


@dataclass(frozen=True)
class SealedSegment:
    segment_id: str  # unique and stable across restarts (e.g. "<rank-dir>/<seq>")
    path: Path  # the sealed file; immutable until the SSD tier evicts it
    size: int  # file size in bytes (records + footer)
    entries: tuple[SegmentEntry, ...]  # in file order
    sealed_at: float  # unix time


class SegmentSource(Protocol):
    """Implemented by the SSD tier; used by the background flusher."""

    def unflushed_segments(self) -> list[SealedSegment]:
        """Sealed segments not yet confirmed in the object tier, oldest first."""
        ...

    def mark_flushed(self, segment_id: str) -> None:
        """Record durably that the segment is in the object tier (it becomes evictable)."""
        ...

    def pin_segment(self, segment_id: str) -> bool:
        """Keep the segment's file from eviction while it is uploaded; False if already gone."""
        ...

    def unpin_segment(self, segment_id: str) -> None: ...
