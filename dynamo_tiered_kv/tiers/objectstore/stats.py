"""The object tier's counters, shared by the tier and its write path (read by metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ObjectTierStats:
    """Counters for metrics (monotonic)."""

    gets: int = 0  # ranged GETs issued by read_many
    runs: int = 0  # contiguous runs read (== gets)
    records_read: int = 0
    corrupt_reads: int = 0  # records that failed verification twice (never served)
    reread_ok: int = 0  # records that failed once and verified on the re-read (served)
    quarantined: int = 0  # quarantine markers written
    missing_objects: int = 0
    objects_published: int = 0
    objects_deduplicated: int = 0  # publish found the data already there (another node)
    evicted_objects: int = 0
    reuploaded_objects: int = 0  # data deleted (by gc) between our data and manifest puts
    corrupt_copies_bypassed: int = 0  # stored copies not reused: records of them were reported corrupt
    stale_index_objects: int = 0  # indexed objects whose manifest was gone when a flush checked
    snapshot_loads: int = 0  # index builds that started from a snapshot
    snapshot_rejected: int = 0  # snapshots ignored (checksum, format): rebuilt from manifests
    snapshots_written: int = 0
    index_build_s: float = 0.0  # duration of the last background index build
