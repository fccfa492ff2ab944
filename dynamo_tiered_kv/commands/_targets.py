"""What the object-tier commands (``fsck``, ``gc``) check about a target before they open it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse


def missing_local_root(url: str) -> str | None:
    """Why a ``file://`` target cannot be checked (its directory is missing or is not a directory);
    ``None`` for one that exists, for a malformed file URL and for every other scheme (S3 reports a
    missing bucket itself).

    The commands only read and delete what is there: opening the backend would create the
    directory a mistyped URL names, and report it clean."""
    u = urlparse(url)
    if u.scheme != "file" or u.netloc not in ("", "localhost"):  # a malformed file URL: backend_from_url says so
        return None
    root = Path(unquote(u.path))
    if not root.exists():
        return f"{url}: no such directory {root}"
    if not root.is_dir():
        return f"{url}: {root} is not a directory"
    return None
