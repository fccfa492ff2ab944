"""Local-directory object backend: the embedded default, with the same semantics as S3.

Object ``name`` is the file ``root/name``. Publishing writes a temp file ``.<base>.<uuid>.partial``
(``O_EXCL``) in the target directory, checks every write for shortness, ``fsync``s it, then
renames it into place (``os.replace``, or ``os.link`` for ``if_absent`` so an existing object is
never replaced) and ``fsync``s the directory. A crash leaves either the old state or the whole
object, plus at most a temp file that listing ignores and GC removes. Every blocking syscall
runs in a worker thread (module-level helpers below), never on the event loop, and a cancelled
caller waits for its thread (``run_in_thread``): no write into its buffers after it returns.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from ...errors import TierUnavailable
from .._fileio import fsync_dir
from .backend import FileSource, ObjectBackend, ObjectInfo, Source
from .threads import run_in_thread

_COPY_CHUNK = 8 << 20
_PARTIAL = ".partial"


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        n = os.write(fd, data)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]


def _copy_file(fd: int, src: FileSource) -> None:
    with open(src.path, "rb", buffering=0) as f:
        pos, end = src.offset, src.offset + src.length
        while pos < end:
            n = os.copy_file_range(f.fileno(), fd, end - pos, pos) if hasattr(os, "copy_file_range") else 0
            if n == 0:  # fallback (or EOF: detected below)
                chunk = os.pread(f.fileno(), min(_COPY_CHUNK, end - pos), pos)
                if not chunk:
                    raise OSError(errno.EIO, f"{src.path} ended at {pos}, expected {end} bytes")
                _write_all(fd, memoryview(chunk))
                n = len(chunk)
            pos += n


def _put(root: Path, name: str, src: Source, if_absent: bool) -> bool:
    final = root / name
    final.parent.mkdir(parents=True, exist_ok=True)
    if if_absent and final.exists():
        return False
    tmp = final.parent / f".{final.name}.{uuid.uuid4().hex}{_PARTIAL}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            if isinstance(src, FileSource):
                _copy_file(fd, src)
            else:
                _write_all(fd, memoryview(src).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
        if if_absent:
            try:
                os.link(tmp, final)  # atomic create-if-absent
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        else:
            os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(final.parent)
    return True


def _get_range(path: str, offset: int, dests: Sequence[memoryview]) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        bufs = [d.cast("B") if d.format != "B" else d for d in dests]
        total = sum(b.nbytes for b in bufs)
        done = 0
        while bufs:
            n = os.preadv(fd, bufs, offset + done)
            if n == 0:
                return None  # object shorter than the range: nothing usable
            done += n
            while bufs and n >= bufs[0].nbytes:
                n -= bufs[0].nbytes
                bufs.pop(0)
            if bufs and n:
                bufs[0] = bufs[0][n:]
        return total
    finally:
        os.close(fd)


def _list(root: Path, prefix: str, start_after: str = "") -> list[ObjectInfo]:
    # Walk only the directory part of the prefix; filter names before the (costly) stat.
    base = root / prefix.rsplit("/", 1)[0] if "/" in prefix else root
    if not base.is_dir():
        return []
    names: list[str] = []
    for dirpath, _dirs, files in os.walk(base):
        rel = Path(dirpath).relative_to(root).as_posix()
        rel = "" if rel == "." else rel + "/"
        for f in files:
            if f.startswith("."):
                continue  # temp / partial files are never visible
            name = rel + f
            if name.startswith(prefix) and name > start_after:
                names.append(name)
    names.sort()
    out: list[ObjectInfo] = []
    top = str(root)
    for name in names:
        try:
            st = os.stat(os.path.join(top, name))
        except FileNotFoundError:
            continue
        out.append(ObjectInfo(name, st.st_size, st.st_mtime))
    return out


def _list_dirs(root: Path, prefix: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(root / prefix) if e.is_dir() and not e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _head(path: str, name: str) -> ObjectInfo | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return ObjectInfo(name, st.st_size, st.st_mtime)


def _delete(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _sweep_partials(root: Path, older_than_s: float) -> int:
    n, cutoff = 0, time.time() - older_than_s
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.startswith(".") and f.endswith(_PARTIAL):
                p = Path(dirpath) / f
                with contextlib.suppress(FileNotFoundError):
                    if p.stat().st_mtime < cutoff:
                        p.unlink()
                        n += 1
    return n


class LocalDirBackend(ObjectBackend):
    """Objects as files under ``root`` (created if missing).

    Args:
        root: directory holding the objects; a shared filesystem (NFS, CephFS) makes it a
            cross-node store with the same publish semantics.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root)
        self._top = str(self.root)
        self.url = f"file://{self.root.resolve()}"

    def __repr__(self) -> str:
        return f"LocalDirBackend({str(self.root)!r})"

    def _path(self, name: str) -> str:
        # a str, not a Path: pathlib interns every name part, and a listing of millions of
        # manifests left the interpreter's intern table at MBs (about 2 B per indexed block)
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"invalid object name {name!r}")
        return os.path.join(self._top, name)

    async def _io(self, fn, *args):
        try:
            return await run_in_thread(fn, *args)
        except OSError as e:
            self.stats.failures += 1
            raise TierUnavailable(f"{self.url}: {e}") from e

    async def open(self) -> None:
        await self._io(lambda: self.root.mkdir(parents=True, exist_ok=True))

    async def put_object(self, name: str, source: Source, *, if_absent: bool = False) -> bool:
        path = self._path(name)
        wrote = await self._io(_put, self.root, name, source, if_absent)
        if wrote:
            self.stats.puts += 1
            self.stats.bytes_written += os.stat(path).st_size if isinstance(source, FileSource) else \
                memoryview(source).nbytes
        return wrote

    async def get_range(self, name: str, offset: int, dests: Sequence[memoryview]) -> int | None:
        n = await self._io(_get_range, self._path(name), offset, dests)
        self.stats.gets += 1
        if n:
            self.stats.bytes_read += n
        return n

    async def head(self, name: str) -> ObjectInfo | None:
        self.stats.heads += 1
        return await self._io(_head, self._path(name), name)

    async def list(self, prefix: str = "", *, start_after: str = "") -> list[ObjectInfo]:
        self.stats.lists += 1
        return await self._io(_list, self.root, prefix, start_after)

    async def list_dirs(self, prefix: str) -> list[str]:
        self.stats.lists += 1
        return await self._io(_list_dirs, self.root, prefix)

    async def delete(self, name: str) -> bool:
        self.stats.deletes += 1
        return await self._io(_delete, self._path(name))

    async def abort_incomplete(self, older_than_s: float) -> int:
        return await self._io(_sweep_partials, self.root, older_than_s)
