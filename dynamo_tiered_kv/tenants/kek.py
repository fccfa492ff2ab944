"""Key-encryption keys (KEKs): the versioned root keys that wrap every tenant key.

A ``KeySource`` holds ``{version id: 32-byte key}`` and names the current version: new tenant keys
are wrapped under the current version, and a tenant key wrapped under any version the source
still holds can be read (docs/ENCRYPTION.md, rotation). The material comes from one of:

* a file (``KeySource.from_file``) or an environment variable (``KeySource.from_env``) in the
  *text* form: entries ``<version>=<base64 key>`` separated by newlines, commas or semicolons,
  ``#`` comments and blank lines ignored, plus ``current=<version>``; or the *JSON* form
  ``{"current": "<version>", "keys": {"<version>": "<base64 key>", ...}}``;
* a directory (``KeySource.from_dir``), e.g. a mounted Kubernetes Secret: one file per version
  whose name is the version id and whose content is the key (base64 text, or the 32 raw bytes),
  plus a file ``current`` holding the current version id. Names starting with ``.`` (the
  ``..data`` links Kubernetes adds) are skipped.

With a single version, ``current`` may be omitted. Version ids are 1-32 characters of
``[A-Za-z0-9._-]`` starting with a letter or digit; ``current`` is reserved.

Malformed material raises ``ConfigError`` naming the origin (path or variable) and the version,
never the key bytes; ``repr``/``str`` show versions only.

Following a rotated source: a file or directory source re-reads itself when it changes, so a
rotated Kubernetes Secret reaches running workers without a restart. Each read of the keys
(``current``, ``current_key``, ``get``, ``versions``) at most once per ``check_s`` (5 s by
default) stats the origin (the file, or the directory, its ``..data`` link and every entry,
following symlinks: the kubelet swaps ``..data`` to a new directory atomically); when the stat
changed, the origin is re-read and swapped in whole. New wraps then use the new current version;
older versions still in the source stay readable; a version gone from the source no longer opens
anything it wrapped (a miss for those tenants). A change that does not parse keeps the keys in
use (logged, retried at the next change). An environment variable cannot change under a running
process: ``from_env`` sources never re-read themselves.

Threading: a ``KeySource`` is an immutable snapshot swapped whole by ``reload``; any thread may
read it at any time. The change check runs on the reading thread (a stat, and a small read when
the origin changed); one thread checks at a time, the others read the keys in use meanwhile.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

#: bytes in a KEK (AES-256)
KEK_BYTES = 32
#: the reserved entry / file name that names the current version
CURRENT = "current"
#: environment variable read by ``KeySource.from_env`` by default
DEFAULT_ENV = "DTKV_TENANT_KEKS"
#: seconds between two checks of a file or directory source for a change (module docstring)
RELOAD_CHECK_S = 5.0
#: the link a mounted Kubernetes Secret swaps to publish a new version of its files
_K8S_DATA = "..data"

# At most 32 characters: a base64 key (43 characters before its padding) is never a valid id,
# so a key written where an id belongs is refused as an invalid id, which errors do not echo.
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")
_SEPARATORS = re.compile(r"[\n\r,;]+")


def check_version(version: str, origin: str = "KEK source", *, echo: bool = False) -> str:
    """``version`` if it is a valid KEK version id, else ``ConfigError``. The rejected text is
    shown only with ``echo`` (a file name): in the text and JSON forms it may be key material."""
    if not isinstance(version, str) or not _VERSION.fullmatch(version) or version == CURRENT:
        shown = f" {version!r}" if echo else ""
        raise ConfigError(f"{origin}: invalid KEK version id{shown} (1-32 characters of "
                          f"[A-Za-z0-9._-], starting with a letter or digit, not {CURRENT!r})")
    return version


def _decode_key(value: str | bytes, origin: str, version: str, *, raw_ok: bool = False) -> bytes:
    """The 32 key bytes from base64 text (or the raw bytes where ``raw_ok``). Errors say what is
    wrong with the material (its length, not its content)."""
    if raw_ok and isinstance(value, bytes) and len(value) == KEK_BYTES:
        return value
    text = value.decode("ascii", errors="replace") if isinstance(value, bytes) else value
    try:
        key = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        # no chaining: the original exception may carry the material
        raise ConfigError(f"{origin}: KEK version {version!r} is not valid base64"
                          + (f" nor {KEK_BYTES} raw bytes" if raw_ok else "")) from None
    if len(key) != KEK_BYTES:
        raise ConfigError(f"{origin}: KEK version {version!r} decodes to {len(key)} bytes, "
                          f"expected {KEK_BYTES}")
    return key


def _parse_text(text: str, origin: str) -> tuple[dict[str, bytes], str | None]:
    keys: dict[str, bytes] = {}
    current: str | None = None
    for n, line in enumerate(_SEPARATORS.split(text), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        name, sep, value = entry.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(f"{origin}: entry {n} is not '<version>=<base64 key>' nor 'current=<version>'")
        if name == CURRENT:
            current = check_version(value.strip(), origin)
            continue
        check_version(name, origin)
        if name in keys:
            raise ConfigError(f"{origin}: KEK version {name!r} is given twice")
        keys[name] = _decode_key(value, origin, name)
    return keys, current


def _parse_json(text: str, origin: str) -> tuple[dict[str, bytes], str | None]:
    try:
        doc: Any = json.loads(text)
    except ValueError:
        raise ConfigError(f"{origin}: not valid JSON") from None  # the error object holds the text
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), dict) or set(doc) - {"keys", CURRENT}:
        raise ConfigError(f'{origin}: expected {{"current": "<version>", "keys": {{"<version>": '
                          f'"<base64 key>"}}}}')
    keys: dict[str, bytes] = {}
    for name, value in doc["keys"].items():
        check_version(name, origin)
        if not isinstance(value, str):
            raise ConfigError(f"{origin}: KEK version {name!r} must be a base64 string")
        keys[name] = _decode_key(value, origin, name)
    current = doc.get(CURRENT)
    if current is not None and not isinstance(current, str):
        raise ConfigError(f"{origin}: 'current' must be a version id string")
    return keys, (check_version(current, origin) if current is not None else None)


def parse_keys(text: str, origin: str) -> tuple[dict[str, bytes], str | None]:
    """``({version: key}, current or None)`` from the text or JSON form (module docstring)."""
    if text.lstrip().startswith("{"):
        return _parse_json(text, origin)
    return _parse_text(text, origin)


def _stat_stamp(path: Path) -> Hashable:
    """What identifies the current content of ``path`` (symlinks followed) without reading it."""
    try:
        st = path.stat()
    except OSError as e:
        return ("missing", e.errno)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _file_stamp(path: Path) -> Callable[[], Hashable]:
    return lambda: _stat_stamp(path)


def _dir_stamp(path: Path) -> Callable[[], Hashable]:
    """The directory, where its ``..data`` link points, and every visible entry (followed)."""

    def stamp() -> Hashable:
        try:
            names = sorted(n for n in os.listdir(path) if not n.startswith("."))
            data = os.readlink(path / _K8S_DATA) if (path / _K8S_DATA).is_symlink() else None
        except OSError as e:
            return ("missing", e.errno)
        return _stat_stamp(path), data, tuple((n, _stat_stamp(path / n)) for n in names)

    return stamp


class KeySource:
    """Versioned KEKs and the current version (module docstring for the origins and formats).

    Args:
        keys: ``{version id: 32-byte key}``, at least one.
        current: the version new wraps use; may be omitted when ``keys`` has one version.
        origin: printable origin for errors and ``repr`` (a path or variable name, never material).

    Raises:
        ConfigError: no keys, a key of the wrong length, an invalid version id, no current
            version (several keys and none named) or a current version with no key.
    """

    def __init__(self, keys: Mapping[str, bytes], current: str | None = None, *, origin: str = "memory") -> None:
        self._origin = origin
        self._reader: Any = None  # re-reads the origin for reload(); None for in-memory sources
        # one tuple, swapped whole: a reader never sees new keys with an old current version
        self._state: tuple[dict[str, bytes], str] = self._validated(dict(keys), current, origin)
        # following changes of the origin (file and directory sources; module docstring)
        self._stamp: Callable[[], Hashable] | None = None
        self._seen: Hashable = None  # the origin's stamp when it was last read
        self.check_s = RELOAD_CHECK_S
        self._clock: Callable[[], float] = time.monotonic
        self._next_check = 0.0
        self._checking = threading.Lock()

    @staticmethod
    def _validated(keys: dict[str, bytes], current: str | None, origin: str) -> tuple[dict[str, bytes], str]:
        if not keys:
            raise ConfigError(f"{origin}: no KEK versions")
        for version, key in keys.items():
            check_version(version, origin)
            if not isinstance(key, bytes | bytearray) or len(key) != KEK_BYTES:
                n = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
                raise ConfigError(f"{origin}: KEK version {version!r} is {n} bytes, expected {KEK_BYTES}")
        if current is None:
            if len(keys) != 1:
                raise ConfigError(f"{origin}: no current KEK version among {sorted(keys)} "
                                  f"(add '{CURRENT}=<version>')")
            current = next(iter(keys))
        if current not in keys:
            raise ConfigError(f"{origin}: current KEK version {current!r} has no key "
                              f"(versions: {sorted(keys)})")
        return {v: bytes(k) for v, k in keys.items()}, current

    # --- origins -------------------------------------------------------------------------------

    @classmethod
    def from_text(cls, text: str, *, origin: str = "text") -> KeySource:
        """From the text or JSON form."""
        keys, current = parse_keys(text, origin)
        return cls(keys, current, origin=origin)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, check_s: float = RELOAD_CHECK_S,
                  clock: Callable[[], float] = time.monotonic) -> KeySource:
        """From a file in the text or JSON form; ``reload`` re-reads it, and so does any read of
        the keys once the file changed (checked at most every ``check_s`` seconds of ``clock``)."""
        p = Path(path)
        origin = f"file:{p}"

        def read() -> tuple[dict[str, bytes], str | None]:
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"{origin}: cannot read KEK file ({type(e).__name__})") from None
            return parse_keys(text, origin)

        return cls._with_reader(read, origin, _file_stamp(p), check_s, clock)

    @classmethod
    def from_env(cls, name: str = DEFAULT_ENV, environ: Mapping[str, str] | None = None) -> KeySource:
        """From environment variable ``name`` in the text or JSON form (``environ``: a mapping to
        read instead of ``os.environ``); ``reload`` re-reads it (it never re-reads itself: a
        process's environment does not change from outside)."""
        origin = f"env:{name}"
        env = os.environ if environ is None else environ

        def read() -> tuple[dict[str, bytes], str | None]:
            text = env.get(name)
            if text is None or not text.strip():
                raise ConfigError(f"{origin}: environment variable is unset or empty")
            return parse_keys(text, origin)

        return cls._with_reader(read, origin)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], *, check_s: float = RELOAD_CHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> KeySource:
        """From a directory: one file per version (name = version id, content = base64 or raw
        key) and ``current`` naming the current version; ``reload`` re-reads it, and so does any
        read of the keys once the directory changed (a mounted Kubernetes Secret is updated in
        place when the Secret changes; checked at most every ``check_s`` seconds of ``clock``)."""
        d = Path(path)
        origin = f"dir:{d}"

        def read() -> tuple[dict[str, bytes], str | None]:
            keys: dict[str, bytes] = {}
            current: str | None = None
            try:
                entries = sorted(e for e in d.iterdir() if not e.name.startswith(".") and e.is_file())
                for e in entries:
                    data = e.read_bytes()
                    if e.name == CURRENT:
                        current = check_version(data.decode("utf-8", errors="replace").strip(), f"{origin}/{CURRENT}")
                    else:
                        version = check_version(e.name, origin, echo=True)
                        keys[version] = _decode_key(data, origin, version, raw_ok=True)
            except OSError as e:
                raise ConfigError(f"{origin}: cannot read KEK directory ({type(e).__name__}: "
                                  f"{e.strerror})") from None
            return keys, current

        return cls._with_reader(read, origin, _dir_stamp(d), check_s, clock)

    @classmethod
    def _with_reader(cls, read: Any, origin: str, stamp: Callable[[], Hashable] | None = None,
                     check_s: float = RELOAD_CHECK_S, clock: Callable[[], float] = time.monotonic) -> KeySource:
        if not check_s > 0:
            raise ConfigError(f"{origin}: check_s must be positive, got {check_s}")
        seen = stamp() if stamp is not None else None  # before the read: a change during it is seen next
        keys, current = read()
        src = cls(keys, current, origin=origin)
        src._reader = read
        src._stamp, src._seen, src.check_s, src._clock = stamp, seen, check_s, clock
        src._next_check = clock() + check_s
        return src

    def reload(self) -> None:
        """Re-read the origin (file, variable, directory) and swap the keys in whole. On an error
        the previous keys stay and ``ConfigError`` is raised. In-memory sources do not change."""
        if self._reader is None:
            return
        keys, current = self._reader()
        self._state = self._validated(keys, current, self._origin)

    def _fresh(self) -> tuple[dict[str, bytes], str]:
        """The keys in use, re-read first when the origin changed (module docstring)."""
        if self._stamp is not None and self._clock() >= self._next_check:
            self._follow()
        return self._state

    def _follow(self) -> None:
        if not self._checking.acquire(blocking=False):
            return  # another thread is checking: use the keys in use meanwhile
        try:
            now = self._clock()
            if now < self._next_check or self._stamp is None:
                return
            self._next_check = now + self.check_s
            stamp = self._stamp()
            if stamp == self._seen:
                return
            self._seen = stamp  # a broken change is not re-read until the origin changes again
            before = self._state
            try:
                self.reload()
            except ConfigError as e:
                log.error("KEK source changed but cannot be used; keeping versions %s (current %s): %s",
                          sorted(before[0]), before[1], e)
                return
            keys, current = self._state
            if (keys, current) != before:
                log.info("KEK source %s changed: versions %s, current %s", self._origin, sorted(keys), current)
        finally:
            self._checking.release()

    # --- reading -------------------------------------------------------------------------------

    @property
    def origin(self) -> str:
        return self._origin

    @property
    def current(self) -> str:
        """The version new wraps use."""
        return self._fresh()[1]

    def current_key(self) -> tuple[str, bytes]:
        """``(current version, its key)`` read together, consistent across a concurrent reload."""
        keys, current = self._fresh()
        return current, keys[current]

    def get(self, version: str) -> bytes | None:
        """The key of ``version``, or None if this source does not hold it."""
        return self._fresh()[0].get(version)

    def versions(self) -> tuple[str, ...]:
        """Every version held, sorted."""
        return tuple(sorted(self._fresh()[0]))

    def __repr__(self) -> str:
        keys, current = self._state  # never re-reads: repr must not do I/O
        return f"KeySource(origin={self._origin!r}, versions={tuple(sorted(keys))!r}, current={current!r})"

    __str__ = __repr__
