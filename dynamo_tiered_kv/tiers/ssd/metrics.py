"""Prometheus metrics of the SSD tier (process-wide; every SSDTier instance adds to them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

BYTES_WRITTEN = Counter("dtkv_ssd_written_bytes", "Record bytes appended to SSD segments")
BYTES_READ = Counter("dtkv_ssd_read_bytes", "Bytes read from SSD segments")
READ_ERRORS = Counter("dtkv_ssd_read_errors", "SSD reads that failed with an I/O error (served as misses)")
CHECKSUM_FAILURES = Counter("dtkv_ssd_checksum_failures", "SSD records that failed verification on read")
EVICTED_SEGMENTS = Counter("dtkv_ssd_evicted_segments", "Whole segments evicted for capacity")
SEALED_SEGMENTS = Counter("dtkv_ssd_sealed_segments", "Segments sealed with a footer")
TORN_TAIL_BYTES = Counter("dtkv_ssd_torn_tail_bytes", "Bytes truncated from unsealed segments at recovery")
DEGRADED = Counter("dtkv_ssd_degraded", "Times the SSD tier stopped accepting writes", ["reason"])
DISABLED = Gauge("dtkv_ssd_disabled", "SSD tiers in this process that are disabled (no SSD tier)")
USED_BYTES = Gauge("dtkv_ssd_used_bytes", "Bytes of segment files held by the SSD tier")
GDS_AVAILABLE = Gauge("dtkv_ssd_gds_available", "GPUDirect Storage probe verdict (1 usable, 0 host bounce)")
IO_PATH = Gauge("dtkv_ssd_io_path", "I/O path in use (1 for the selected one)", ["path"])
GPU_DIRECT_ACTIVE = Gauge("dtkv_ssd_gpu_direct_active", "SSD tiers moving records straight to/from device memory")
GPU_DIRECT_BYTES = Counter("dtkv_ssd_gpu_direct_bytes", "Bytes moved between device memory and SSD", ["op"])
GPU_DIRECT_FAILURES = Counter("dtkv_ssd_gpu_direct_failures",
                              "GPU-direct transfers that failed; the tier then falls back to host bounce")
DAMAGED_RECORDS = Counter("dtkv_ssd_damaged_records",
                          "Damaged regions recovery skipped in SSD segments (kept out of the index, not cut)")
QUARANTINED = Counter("dtkv_ssd_quarantined",
                      "Unusable entries of a rank directory renamed aside so the rest is served")
RECLAIMED_SEGMENTS = Counter("dtkv_ssd_reclaimed_segments",
                             "Sealed segments unlinked because every record in them was deleted")
PUNCHED_BYTES = Counter("dtkv_ssd_punched_bytes", "Bytes of deleted records freed by punching holes in segments")
PUNCH_UNSUPPORTED = Counter("dtkv_ssd_punch_unsupported",
                            "SSD tiers whose filesystem refused hole punching (deleted bytes wait for eviction)")
