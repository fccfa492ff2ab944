"""How the scheduler role reaches the worker role's store for ``lookup``.

The store (and the index of what it holds) lives with the KV tensors, in the worker. vLLM puts
the scheduler either in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uniproc
executor) or in the EngineCore process with workers forked beside it. Both cases:

* same process: the worker registers a lookup function under ``(engine_id, dp_rank)``; the
  scheduler calls it directly;
* other process: TP rank 0 also serves that function on a Unix socket named after the engine id
  (``multiprocessing.connection``, authenticated with the engine id); the scheduler makes one
  round trip per request (never one per block).

Other ranks hold their own shards; a rank that lacks a block the leader has reports it as a
load error and vLLM recomputes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener

log = logging.getLogger(__name__)

LookupFn = Callable[[Sequence[bytes]], tuple[int, tuple[str, ...]]]
_LOCAL: dict[str, LookupFn] = {}
_LOCK = threading.Lock()


def engine_key(engine_id: str, dp_rank: int) -> str:
    return f"{engine_id}-dp{dp_rank}"


_SUN_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL


def socket_path(key: str) -> str:
    """The lookup socket of an engine: under TMPDIR, or under /tmp by a hashed name when that path
    would overflow ``sun_path`` (a long TMPDIR would otherwise turn every lookup into a miss)."""
    path = os.path.join(tempfile.gettempdir(), f"dtkv-{key}.sock")
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return path
    return os.path.join("/tmp", f"dtkv-{hashlib.blake2b(key.encode(), digest_size=10).hexdigest()}.sock")


def register_local(key: str, fn: LookupFn) -> None:
    with _LOCK:
        _LOCAL[key] = fn


def unregister_local(key: str) -> None:
    with _LOCK:
        _LOCAL.pop(key, None)


class LookupServer:
    """Serves ``fn(token_hashes)`` on a Unix socket until ``close``."""

    def __init__(self, key: str, fn: LookupFn, authkey: bytes) -> None:
        self.path = socket_path(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a crashed engine with the same id
        self._fn = fn
        self._listener = Listener(self.path, family="AF_UNIX", authkey=authkey)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="dtkv-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:
                if self._closed:
                    return
                log.exception("lookup server accept failed")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dtkv-lookup-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while not self._closed:
                try:
                    hashes = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    result = self._fn(hashes)
                except Exception:
                    log.exception("lookup failed")
                    result = (0, ())
                conn.send(result)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LookupClient:
    """Scheduler-side handle: finds the worker's lookup (in process or over the socket) lazily."""

    def __init__(self, key: str, authkey: bytes) -> None:
        self._key = key
        self._authkey = authkey
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._warned = False

    def lookup(self, token_hashes: Sequence[bytes]) -> tuple[int, tuple[str, ...]]:
        """Number of leading blocks restorable and the tier of each; (0, ()) if no worker answers."""
        if not token_hashes:
            return 0, ()
        fn = _LOCAL.get(self._key)
        if fn is not None:
            return fn(token_hashes)
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = Client(socket_path(self._key), family="AF_UNIX", authkey=self._authkey)
                self._conn.send(list(token_hashes))
                return self._conn.recv()
            except (OSError, EOFError) as e:
                if self._conn is not None:
                    with contextlib.suppress(Exception):
                        self._conn.close()
                self._conn = None
                if not self._warned:
                    log.warning("tiered KV store lookup unavailable (%s); treating as misses", e)
                    self._warned = True
                return 0, ()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None
