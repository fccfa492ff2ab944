"""The key epoch of SGLang pages: what a cache reset changes so that older pages are never read again.

Each rank computes its own keys, and with MLA every rank reads the one copy the writer rank stored,
so every rank must arrive at the same epoch without talking to the others. SGLang runs a cache
flush (weight updates, ``/flush_cache``) and ``/clear_hicache_storage_backend`` on every rank, so
the epoch is a digest of what they all share: the number of resets so far, SGLang's weight version
at the reset, and a token of this server's launch (``launch_token``). Epoch 0 (no reset yet) is
empty: pages of the weights a server starts with stay shared across servers and restarts, which the
namespace's model identity already guards. After a reset, pages are shared only within the launch.

A page set that began before a reset keeps the epoch it entered with, so old-weight pages never
land under the new epoch, and a reset waits (bounded) for such sets so that the local drop after
it finds everything they queued.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_LAUNCH_KEY = "dynamo_tiered_kv/sglang/launch_token"
_SET_WAIT_S = 30.0  # a set only gathers pages and queues them; far longer means it is stuck


def launch_token() -> str:
    """A random token that every rank of one SGLang launch agrees on: the first rank to ask puts it
    in torch.distributed's rendezvous store (shared by all ranks, across nodes) and the others read
    it. "" when no process group is up (every rank then derives epochs from the count and version)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        if not dist.is_available() or not dist.is_initialized():
            return ""
        return _get_default_store().compare_set(_LAUNCH_KEY, "", secrets.token_hex(8)).decode()
    except Exception:
        log.warning("no launch token from torch.distributed's store; epochs after a reset are shared "
                    "by every server at the same reset count and weight version", exc_info=True)
        return ""


def served_weight_version() -> str:
    """SGLang's weight version now (a weight update that names one changes it before the flush)."""
    try:
        from sglang.srt.runtime_context import get_serving

        return str(get_serving().weight_version)
    except Exception:
        return ""


class KeyEpoch:
    """The current epoch, the in-flight page sets, and the reset that advances it."""

    def __init__(self, token: str = "") -> None:
        self._token = token
        self._resets = 0
        self._value = b""
        self._setting = 0
        self._cond = threading.Condition()

    @property
    def value(self) -> bytes:
        return self._value

    @property
    def resets(self) -> int:
        return self._resets

    @contextmanager
    def setting(self) -> Iterator[bytes]:
        """The epoch a page set writes under, fixed at its entry."""
        with self._cond:
            self._setting += 1
            value = self._value
        try:
            yield value
        finally:
            with self._cond:
                self._setting -= 1
                self._cond.notify_all()

    def advance(self, weight_version: str) -> bytes:
        """A reset: wait for sets in flight, then move every later key to the next epoch."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._setting == 0, timeout=_SET_WAIT_S):
                log.warning("%d page sets still in flight after %.0f s; they keep the old epoch",
                            self._setting, _SET_WAIT_S)
            self._resets += 1
            blob = f"{self._token}\0{self._resets}\0{weight_version}".encode()
            self._value = hashlib.blake2b(blob, digest_size=16, person=b"dtkv-sgl-epoch").digest()
            return self._value
