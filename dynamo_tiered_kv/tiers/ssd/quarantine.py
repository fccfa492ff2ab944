"""Set aside one unusable entry of a rank directory so the rest of the tier keeps serving.

A stray directory named like a segment, a ``tombstones.log`` that is not a file, or a segment
that cannot be opened or read would otherwise fail recovery as a whole and disable the tier. The
entry is renamed to ``<name>.quarantine-<unix ns>`` (which no tier code lists again), counted in
``dtkv_ssd_quarantined`` and named in one error log line; an operator inspects or deletes it.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from pathlib import Path

from . import metrics

log = logging.getLogger(__name__)

_QUARANTINED_SEG_RE = re.compile(r"^seg-(\d{8,})\.dtkv\.quarantine-\d+$")


def quarantine(path: Path, why: str) -> Path | None:
    """Rename ``path`` aside; returns the new path (None when even the rename failed)."""
    dest = path.with_name(f"{path.name}.quarantine-{time.time_ns()}")
    try:
        os.rename(path, dest)
    except OSError as e:  # e.g. a read-only filesystem: the caller still skips the entry
        log.error("SSD tier: %s is unusable (%s) and cannot be renamed aside (%s); skipping it", path, why, e)
        metrics.QUARANTINED.inc()
        return None
    log.error("SSD tier: %s is unusable (%s); quarantined as %s, the rest is served", path, why, dest.name)
    metrics.QUARANTINED.inc()
    return dest


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses anything but a regular file (never blocks on a FIFO).

    Raises:
        OSError: the open failed, or ``path`` is a directory, FIFO, socket or device.
    """
    fd = os.open(path, flags | os.O_NONBLOCK, mode)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"{path.name} is not a regular file (mode {stat.filemode(mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """The whole content of a regular file (``open_regular``'s refusals apply)."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        return b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    finally:
        os.close(fd)


def is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def highest_quarantined_seq(rank_dir: Path) -> int:
    """Highest seq among quarantined segments (0: none), so their numbers are never reused."""
    best = 0
    try:
        names = os.listdir(rank_dir)
    except OSError:
        return 0
    for name in names:
        m = _QUARANTINED_SEG_RE.match(name)
        if m:
            best = max(best, int(m.group(1)))
    return best
