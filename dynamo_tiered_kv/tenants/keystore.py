"""Tenant keys: one random 32-byte key per tenant, kept wrapped under a KEK in a shared key store.

Every node reads the same wrapped keys (an object store or a shared directory), so a record
sealed on one node opens on another; deleting a tenant's wrapped key crypto-shreds every record
sealed under it, on every medium, without touching the records (docs/ENCRYPTION.md).

Storage: one small JSON object per tenant, ``<prefix><tenant hex>``::

    {"format": 1, "tenant": "<16 hex>", "ref": "<key reference, 16 hex>",
     "copies": {"<KEK version>": "<base64: 12-byte nonce | 32-byte key encrypted | 16-byte tag>"}}

Each copy is the tenant key sealed with AES-256-GCM under that KEK version, with the tenant id
and the version as associated data (a copy moved to another tenant or relabelled does not
open). One object per tenant, rather than one per KEK version, makes creation a single
conditional write whatever KEK version each node holds as current, and makes rotation one atomic
replace (never a moment with no copy, nor with two different keys).

* ``get_or_create`` is race-safe across nodes: the key is published with ``if_absent``; a node
  that loses the race reads the winner's key. A tenant whose object exists but cannot be
  unwrapped (its KEK version is not in this node's source, or the bytes are damaged) raises
  ``TenantKeyUnreadable`` instead of being given a second key.
* ``rotate`` re-wraps every tenant key under the current KEK version and drops the older copies;
  the tenant keys themselves (and so every record) stay valid. The KEK versions are read from
  the ``KeySource`` at each wrap and unwrap, and a file or directory source follows its origin
  (``tenants.kek``): a rotated Secret's new current version wraps the next tenant key created,
  without a restart, and a version that left the source opens nothing (a miss).
* ``erase`` deletes the tenant's object. Unwrapped keys are cached for ``key_cache_s``: another
  node that had the key cached keeps opening that tenant's records for at most ``key_cache_s``
  after the delete (the erasure bound), then its lookups find nothing. Erase and rotate of the
  same tenant must not run at the same time: a rotation that read the key before the delete
  writes it back.

Threading: the coroutines run on one event loop. ``cached`` and the callable ``lookup`` returns
may be called from any thread (the cache is guarded by a lock); ``lookup`` hands I/O to the loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import TieredKVError
from .cipher import TENANT_BYTES, TENANT_KEY_BYTES, key_ref
from .kek import KeySource

log = logging.getLogger(__name__)

#: object name prefix of the wrapped tenant keys
KEY_PREFIX = "tenant-keys/"
#: version of the stored JSON object
KEY_OBJECT_FORMAT = 1
_WRAP_AAD = b"dtkv tenant key 1\x00"
_NONCE = 12


class TenantKeyError(TieredKVError):
    """A tenant key could not be read or made; the caller skips the write (nothing is stored
    unencrypted) or treats the read as a miss."""


class TenantKeyUnreadable(TenantKeyError):
    """The tenant's wrapped key exists but no copy opens with the KEK versions this node holds."""


class Listed(Protocol):
    """An entry of ``KeyObjects.list``."""

    @property
    def name(self) -> str: ...


class KeyObjects(Protocol):
    """The object store the keys live in: what ``tiers.objectstore.ObjectBackend`` offers
    (``LocalDirBackend`` on a shared filesystem, ``S3Backend``). Faults raise within a bounded
    time (``TierUnavailable``)."""

    async def put_object(self, name: str, source: bytes, *, if_absent: bool = False) -> bool: ...

    async def get_bytes(self, name: str) -> bytes | None: ...

    async def delete(self, name: str) -> bool: ...

    async def list(self, prefix: str = "") -> Sequence[Listed]: ...


@dataclass
class RotationReport:
    """What ``rotate`` did, by tenant."""

    version: str
    rewrapped: list[bytes] = field(default_factory=list)
    already_current: list[bytes] = field(default_factory=list)
    unreadable: list[bytes] = field(default_factory=list)


def _wrap_aad(tenant: bytes, version: str) -> bytes:
    return _WRAP_AAD + tenant + version.encode()


def wrap_tenant_key(kek: bytes, version: str, tenant: bytes, key: bytes) -> str:
    """One stored copy: ``key`` sealed under ``kek`` (random nonce: a KEK wraps few keys)."""
    nonce = os.urandom(_NONCE)
    return base64.b64encode(nonce + AESGCM(kek).encrypt(nonce, key, _wrap_aad(tenant, version))).decode()


def unwrap_tenant_key(kek: bytes, version: str, tenant: bytes, copy: str) -> bytes | None:
    """The tenant key of one stored copy, or None if it does not open under ``kek``."""
    try:
        raw = base64.b64decode(copy, validate=True)
        key = AESGCM(kek).decrypt(raw[:_NONCE], raw[_NONCE:], _wrap_aad(tenant, version))
    except (binascii.Error, ValueError, TypeError, InvalidTag):
        return None
    return key if len(key) == TENANT_KEY_BYTES else None


class TenantKeyStore:
    """Per-tenant keys wrapped under the KEKs of ``keks``, stored in ``objects``.

    Args:
        objects: where the wrapped keys live (``KeyObjects``), opened by the caller.
        keks: the KEK versions this node holds and the current one.
        key_cache_s: how long an unwrapped key is used without re-reading the store; this bounds
            how long another node keeps reading an erased tenant.
        absent_cache_s: how long "this tenant has no key" is remembered by readers (a tenant
            created elsewhere is unreadable here for at most this long).
        clock: seconds, monotonic (a settable clock in tests).
        prefix: object name prefix.
    """

    def __init__(self, objects: KeyObjects, keks: KeySource, *, key_cache_s: float = 60.0,
                 absent_cache_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 prefix: str = KEY_PREFIX) -> None:
        if key_cache_s < 0 or absent_cache_s < 0:
            raise ValueError("key_cache_s and absent_cache_s must be >= 0")
        self._objects = objects
        self._keks = keks
        self.key_cache_s = key_cache_s
        self.absent_cache_s = absent_cache_s
        self._clock = clock
        self._prefix = prefix
        self._lock = threading.Lock()
        self._cache: dict[bytes, tuple[bytes | None, float]] = {}  # tenant -> (key or None, read at)
        self._refreshing: set[bytes] = set()

    def __repr__(self) -> str:
        return f"TenantKeyStore({self._keks!r}, key_cache_s={self.key_cache_s})"

    def object_name(self, tenant: bytes) -> str:
        """Where ``tenant``'s wrapped key is stored."""
        self._check(tenant)
        return self._prefix + tenant.hex()

    # --- cache (any thread) --------------------------------------------------------------------

    def _remember(self, tenant: bytes, key: bytes | None, at: float | None = None) -> None:
        with self._lock:
            self._cache[tenant] = (key, self._clock() if at is None else at)

    def _cached_entry(self, tenant: bytes) -> tuple[bytes | None, float] | None:
        """``(key or None, age)`` if the entry is still valid, else None."""
        with self._lock:
            entry = self._cache.get(tenant)
        if entry is None:
            return None
        key, at = entry
        age = self._clock() - at
        return (key, age) if age < (self.key_cache_s if key is not None else self.absent_cache_s) else None

    def cached(self, tenant: bytes) -> bytes | None:
        """The tenant key if cached and younger than ``key_cache_s``; never does I/O."""
        entry = self._cached_entry(tenant)
        return entry[0] if entry is not None else None

    def forget(self, tenant: bytes | None = None) -> None:
        """Drop the cached key of ``tenant`` (every tenant when None)."""
        with self._lock:
            if tenant is None:
                self._cache.clear()
            else:
                self._cache.pop(tenant, None)

    # --- store ---------------------------------------------------------------------------------

    def _check(self, tenant: bytes) -> None:
        if not isinstance(tenant, bytes) or len(tenant) != TENANT_BYTES:
            raise ValueError(f"a tenant id is {TENANT_BYTES} bytes")

    def _encode(self, tenant: bytes, key: bytes) -> bytes:
        version, kek = self._keks.current_key()
        doc = {"format": KEY_OBJECT_FORMAT, "tenant": tenant.hex(), "ref": key_ref(key).hex(),
               "copies": {version: wrap_tenant_key(kek, version, tenant, key)}}
        return json.dumps(doc, sort_keys=True).encode()

    def _decode(self, tenant: bytes, body: bytes) -> tuple[bytes | None, dict[str, str]]:
        """``(key or None, copies)``: the key from the first copy that opens, the current version
        tried first."""
        try:
            doc: Any = json.loads(body)
            copies = doc["copies"]
            ok = (doc["format"] == KEY_OBJECT_FORMAT and doc["tenant"] == tenant.hex()
                  and isinstance(copies, dict) and all(isinstance(c, str) for c in copies.values()))
            ref = bytes.fromhex(doc["ref"])
        except (ValueError, KeyError, TypeError):
            return None, {}
        if not ok:
            return None, {}
        current = self._keks.current
        for version in sorted(copies, key=lambda v: v != current):
            kek = self._keks.get(version)
            key = unwrap_tenant_key(kek, version, tenant, copies[version]) if kek is not None else None
            if key is not None and key_ref(key) == ref:
                return key, copies
        return None, copies

    async def _load(self, tenant: bytes) -> tuple[bytes | None, bool]:
        """``(key or None, whether an object exists)`` read from the store; updates the cache."""
        # the entry ages from before the read: a read that raced an erase expires no later than
        # key_cache_s after the erase
        started = self._clock()
        body = await self._objects.get_bytes(self.object_name(tenant))
        if body is None:
            self._remember(tenant, None, started)
            return None, False
        key, copies = self._decode(tenant, body)
        if key is None:
            log.error("tenant %s: its key exists but no copy opens with KEK versions %s (copies: %s)",
                      tenant.hex(), self._keks.versions(), sorted(copies))
        self._remember(tenant, key, started)
        return key, True

    async def get(self, tenant: bytes) -> bytes | None:
        """The tenant key, or None if the tenant has none (or none this node can unwrap).

        Raises:
            TierUnavailable: the key store did not answer (a miss for the caller).
        """
        self._check(tenant)
        entry = self._cached_entry(tenant)
        if entry is not None:
            return entry[0]
        return (await self._load(tenant))[0]

    async def get_or_create(self, tenant: bytes) -> bytes:
        """The tenant key, made (32 bytes from ``os.urandom``) and published if the tenant has none.

        Raises:
            TenantKeyUnreadable: a key exists that this node cannot unwrap (never replaced).
            TenantKeyError: the key vanished between a lost creation race and the re-read.
            TierUnavailable: the key store did not answer.
        """
        self._check(tenant)
        entry = self._cached_entry(tenant)
        if entry is not None and entry[0] is not None:
            return entry[0]
        key, present = await self._load(tenant)
        if key is None and not present:
            new = os.urandom(TENANT_KEY_BYTES)
            if await self._objects.put_object(self.object_name(tenant), self._encode(tenant, new), if_absent=True):
                self._remember(tenant, new)
                log.info("tenant %s: created its key (ref %s)", tenant.hex(), key_ref(new).hex())
                return new
            key, present = await self._load(tenant)  # another node won: use its key
        if key is not None:
            return key
        if present:
            raise TenantKeyUnreadable(f"tenant {tenant.hex()}: its key exists but does not open with "
                                      f"KEK versions {self._keks.versions()}")
        raise TenantKeyError(f"tenant {tenant.hex()}: its key was deleted while being created")

    async def erase(self, tenant: bytes) -> bool:
        """Delete every wrapped copy of the tenant's key (crypto-shredding its records) and drop it
        from this node's cache; other nodes stop within ``key_cache_s``. Returns whether the key
        store reported an object (S3 may report True for a missing one)."""
        self._check(tenant)
        existed = await self._objects.delete(self.object_name(tenant))
        self._remember(tenant, None)
        log.warning("tenant %s: key erased", tenant.hex())
        return existed

    async def tenants(self) -> list[bytes]:
        """Every tenant with a stored key."""
        out = []
        for info in await self._objects.list(self._prefix):
            rest = info.name[len(self._prefix):]
            if len(rest) == 2 * TENANT_BYTES:
                try:
                    out.append(bytes.fromhex(rest))
                except ValueError:
                    continue
        return sorted(out)

    async def rotate(self) -> RotationReport:
        """Re-wrap every tenant key under the current KEK version, replacing each object whole
        (the older copies go with it). Keys that no held version opens are left as they are and
        reported. Run it once every node holds the new version as current, and before the old
        version is removed from any source (docs/ENCRYPTION.md)."""
        report = RotationReport(version=self._keks.current)
        for tenant in await self.tenants():
            name = self.object_name(tenant)
            body = await self._objects.get_bytes(name)
            if body is None:
                continue  # erased meanwhile
            key, copies = self._decode(tenant, body)
            if key is None:
                report.unreadable.append(tenant)
                continue
            if set(copies) == {report.version}:
                report.already_current.append(tenant)
                continue
            await self._objects.put_object(name, self._encode(tenant, key))
            self._remember(tenant, key)
            report.rewrapped.append(tenant)
        log.info("KEK rotation to %s: %d re-wrapped, %d already current, %d unreadable", report.version,
                 len(report.rewrapped), len(report.already_current), len(report.unreadable))
        return report

    # --- the hot path's view (any thread) ------------------------------------------------------

    def lookup(self, loop: asyncio.AbstractEventLoop, *,
               timeout_s: float = 2.0) -> Callable[[bytes, bool], bytes | None]:
        """A synchronous ``(tenant, create) -> key or None`` for ``RecordCipher``.

        A cached key is returned at once (and refreshed in the background on ``loop`` once half
        its ``key_cache_s`` is gone, so steady-state callers never wait). Otherwise the read (or,
        with ``create``, get-or-create) runs on ``loop`` and the calling thread waits at most
        ``timeout_s``; a timeout, an unreachable store or an unreadable key gives None (the
        caller recomputes or skips the write). Called on ``loop``'s own thread it never waits:
        it starts the fetch and returns None.
        """

        def fetch(tenant: bytes, create: bool) -> bytes | None:
            entry = self._cached_entry(tenant)
            if entry is not None and (entry[0] is not None or not create):
                if entry[0] is not None and entry[1] > self.key_cache_s / 2:
                    self._refresh_soon(loop, tenant)
                return entry[0]
            coro = self.get_or_create(tenant) if create else self.get(tenant)
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                task = loop.create_task(coro)
                task.add_done_callback(_log_failure)
                return None
            try:
                fut = asyncio.run_coroutine_threadsafe(coro, loop)
            except RuntimeError:  # the loop is closed
                coro.close()
                return None
            try:
                return fut.result(timeout_s)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                log.warning("tenant %s: key store did not answer within %.1f s", tenant.hex(), timeout_s)
            except TieredKVError as e:
                log.warning("tenant %s: no key (%s)", tenant.hex(), e)
            return None

        return fetch

    def _refresh_soon(self, loop: asyncio.AbstractEventLoop, tenant: bytes) -> None:
        with self._lock:
            if tenant in self._refreshing:
                return
            self._refreshing.add(tenant)

        async def refresh() -> None:
            try:
                await self._load(tenant)
            except TieredKVError as e:  # keep the cached key until it expires
                log.warning("tenant %s: key refresh failed (%s)", tenant.hex(), e)
            finally:
                with self._lock:
                    self._refreshing.discard(tenant)

        coro = refresh()
        try:
            asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            with self._lock:
                self._refreshing.discard(tenant)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("tenant key fetch failed: %s", task.exception())
