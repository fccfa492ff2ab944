"""Bucket layout: per-namespace prefixes and time-ordered manifest names (docs/OBJECTS.md).

A tier given a namespace digest keeps everything under ``ns/<namespace hex>/`` (``data/``,
``manifests/``, ``index/``, ``tombstones/``, ``quarantine/``), so a node lists and reads only the
namespaces it serves. ``NamespaceView`` is an ``ObjectBackend`` that adds that prefix: the
manifest, GC, fsck and quarantine code works on a view exactly as on a bucket root.

A name that starts with ``/`` is absolute (relative to the bucket root prefix, not the view):
that is how an index entry points at a data object of the legacy root layout (bucket written
before namespaces), which a namespaced tier still reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .backend import ObjectBackend, ObjectInfo, Source

NS_DIR = "ns/"
INDEX_DIR = "index/"
SNAPSHOT_NAME = f"{INDEX_DIR}snapshot.idx"
# new-style manifest: manifests/t<13-digit created_at ms>-<32 hex>.json; 't' sorts after every
# hex digit, so every legacy name (manifests/<32 hex>.json) lists before every new one
_MANIFEST_RE = re.compile(r"manifests/(?:t(\d{13})-)?([0-9a-f]{32})\.json")
_DATA_RE = re.compile(r"data/([0-9a-f]{32})\.seg")


def ns_prefix(namespace: bytes) -> str:
    return f"{NS_DIR}{namespace.hex()}/"


def manifest_name(created_at: float, mdigest: str) -> str:
    return manifest_name_ms(int(created_at * 1000), mdigest)


def manifest_name_ms(ms: int, mdigest: str) -> str:
    return f"manifests/t{ms:013d}-{mdigest}.json"


def manifest_after(ms: int) -> str:
    """A ``StartAfter`` key: lists every new-style manifest created at ``ms`` or later."""
    return f"manifests/t{max(0, ms):013d}"  # StartAfter is exclusive; "...t<ms>-" sorts after it


def parse_manifest_name(name: str) -> tuple[int, bytes] | None:
    """(created ms or -1 for a legacy name, 16-byte digest) of a canonical manifest name."""
    m = _MANIFEST_RE.fullmatch(name)
    if m is None:
        return None
    return (int(m.group(1)) if m.group(1) else -1), bytes.fromhex(m.group(2))


def parse_data_name(name: str) -> bytes | None:
    m = _DATA_RE.fullmatch(name)
    return None if m is None else bytes.fromhex(m.group(1))


class NamespaceView(ObjectBackend):
    """The objects of ``base`` under ``prefix``; shares ``base``'s connection and counters."""

    def __init__(self, base: ObjectBackend, prefix: str) -> None:
        super().__init__()
        self.base = base
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.stats = base.stats  # one set of request counters per connection
        self.url = f"{base.url.rstrip('/')}/{self.prefix}"

    def __repr__(self) -> str:
        return f"NamespaceView({self.base!r}, {self.prefix!r})"

    def _n(self, name: str) -> str:
        return name[1:] if name.startswith("/") else self.prefix + name

    async def open(self) -> None:
        await self.base.open()

    async def close(self) -> None:
        await self.base.close()

    async def put_object(self, name: str, source: Source, *, if_absent: bool = False) -> bool:
        return await self.base.put_object(self._n(name), source, if_absent=if_absent)

    async def get_range(self, name: str, offset: int, dests: Sequence[memoryview]) -> int | None:
        return await self.base.get_range(self._n(name), offset, dests)

    async def head(self, name: str) -> ObjectInfo | None:
        info = await self.base.head(self._n(name))
        return None if info is None else ObjectInfo(name, info.size, info.mtime)

    async def list(self, prefix: str = "", *, start_after: str = "") -> list[ObjectInfo]:
        cut = len(self.prefix)
        after = self.prefix + start_after if start_after else ""
        return [ObjectInfo(o.name[cut:], o.size, o.mtime)
                for o in await self.base.list(self.prefix + prefix, start_after=after)]

    async def delete(self, name: str) -> bool:
        return await self.base.delete(self._n(name))

    async def get_bytes(self, name: str) -> bytes | None:
        return await self.base.get_bytes(self._n(name))


async def list_namespaces(backend: ObjectBackend) -> list[str]:
    """Hex digests of every namespace prefix in the bucket (``ns/<hex>/``)."""
    return await backend.list_dirs(NS_DIR)
