"""The record cipher: AES-256-GCM over a record's payload, in place, under per-tenant keys.

Key hierarchy (docs/ENCRYPTION.md): a KEK wraps each tenant key (``keystore``); each tenant key
wraps data keys (DEKs) with AES key wrap (RFC 3394); a DEK encrypts payloads. A ``RecordCipher``
draws a fresh random DEK per tenant when it first seals for that tenant, and a new one after
``records_per_dek`` seals, so DEKs are never shared between processes or restarts.

A seal (``SEAL_BYTES``, stored by the codec next to the record) holds what opening needs besides
the tenant key::

    offset size
         0    1  format (SEAL_FORMAT)
         1    3  reserved, zero
         4    8  key reference: which tenant key (HMAC-SHA256(tenant key, label), first 8 bytes;
                 unchanged by KEK rotation, different after an erase and re-creation)
        12   40  the DEK wrapped under the tenant key (AES-KW)
        52   12  nonce: the DEK's record counter, big-endian
        64   16  GCM tag

The GCM associated data is a label, the tenant id, the seal's first 52 bytes and the codec's
``aad``: a payload moved to another tenant or record, or a seal with any byte changed, does not
open.

Nonces: a 96-bit counter per DEK, taken under a lock, starting at 0 and never reaching
``records_per_dek`` (at most 2^31): no (DEK, nonce) pair repeats, within a process or across
processes, as each DEK is random and lives in one ``RecordCipher`` only.

Threading: ``seal`` and ``open`` may be called from any number of threads. They do no I/O of
their own: the tenant key comes from the ``keys`` callable on every call, which must answer from
its cache without I/O in the steady state (``TenantKeyStore.lookup``). The cipher keeps no
tenant key past that call, so erasing a tenant's key stops ``open`` as soon as ``keys`` stops
returning it. ``batch()`` gives one thread a ``CipherBatch`` for one batch of records (a write
or a read of a few MiB, milliseconds long): the same seal and open, with each tenant's key looked
up once for the batch instead of once per record.

Cost (docs/ENCRYPTION.md section 8): ``cryptography`` holds the GIL while it encrypts, so the
cipher's time adds to the process's Python time whatever thread runs it. A seal into a separate
buffer with 16 spare bytes after the payload is one call of the AEAD object (``AESGCM``, built
once per DEK: no key schedule, no per-call objects). An open is one ``AESGCM.decrypt_into`` where
the caller lends 16 bytes after the payload (the tag is put there for the call, the bytes are put
back before it returns), else a GCM context on an ``AES`` object built once per DEK.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

from ..errors import TieredKVError

log = logging.getLogger(__name__)

#: bytes of a tenant id (opaque; all zeros is the default tenant)
TENANT_BYTES = 8
#: bytes of a tenant key and of a DEK (AES-256)
TENANT_KEY_BYTES = 32
DEK_BYTES = 32
#: bytes of the seal a record carries
SEAL_BYTES = 80
SEAL_FORMAT = 1
KEY_REF_BYTES = 8
WRAPPED_DEK_BYTES = DEK_BYTES + 8
NONCE_BYTES = 12
TAG_BYTES = 16
#: seals per DEK before a fresh one is drawn (far below the 2^32 NIST SP 800-38D bound)
MAX_RECORDS_PER_DEK = 2**31

_REF_LABEL = b"dtkv tenant key reference 1"
_AAD_LABEL = b"dtkv record 1\x00"
_AUTH = 52  # seal bytes covered by the associated data: format .. wrapped DEK
_OFF_REF, _OFF_DEK, _OFF_NONCE, _OFF_TAG = 4, 12, 52, 64
_TAIL = 15  # spare output bytes older GCM update_into insists on (AES block - 1)


class TenantKeyUnavailable(TieredKVError):
    """``seal`` found no key for the tenant (key store unreachable, or its key unreadable);
    nothing was encrypted: skip the write, never store the payload in the clear."""


#: ``keys(tenant, create)``: the tenant key or None; ``create`` makes one if the tenant has none
#: (sealing), reads only otherwise (opening). Called on every seal and open, from any thread.
TenantKeys = Callable[[bytes, bool], bytes | None]


def key_ref(tenant_key: bytes) -> bytes:
    """The key reference a seal carries: names the tenant key without revealing it."""
    return hmac.new(tenant_key, _REF_LABEL, hashlib.sha256).digest()[:KEY_REF_BYTES]


@dataclass(frozen=True)
class _Dek:
    """A DEK as the two objects that use it: the algorithm GCM contexts take, and a one-shot AEAD
    (its key schedule done once)."""

    algo: algorithms.AES
    aead: AESGCM

    @classmethod
    def of(cls, dek: bytes) -> _Dek:
        return cls(algorithms.AES(dek), AESGCM(dek))


@dataclass
class _Writer:
    """The DEK one tenant seals under in this cipher; ``next_nonce`` guarded by ``lock``."""

    ref: bytes
    dek: _Dek
    head: bytes  # seal[:52]: format, reserved, key reference, wrapped DEK
    aad_head: bytes  # associated data up to the caller's aad: label, tenant, head
    next_nonce: int
    lock: threading.Lock


class RecordCipher:
    """Seals and opens record payloads in place (module docstring for the scheme).

    Args:
        keys: the tenant-key callable (``TenantKeys``), e.g. ``TenantKeyStore.lookup(loop)``.
        dek_cache: unwrapped DEKs kept for opening (LRU); each writer's own DEK counts as one.
        records_per_dek: seals per DEK before a fresh one (at most ``MAX_RECORDS_PER_DEK``).
    """

    def __init__(self, keys: TenantKeys, *, dek_cache: int = 4096,
                 records_per_dek: int = MAX_RECORDS_PER_DEK) -> None:
        if not 1 <= records_per_dek <= MAX_RECORDS_PER_DEK:
            raise ValueError(f"records_per_dek must be in [1, {MAX_RECORDS_PER_DEK}]")
        if dek_cache < 1:
            raise ValueError("dek_cache must be >= 1")
        self._keys = keys
        self._records_per_dek = records_per_dek
        self._dek_cache_size = dek_cache
        self._lock = threading.Lock()  # guards the three maps below
        self._refs: dict[bytes, tuple[bytes, bytes]] = {}  # tenant -> (tenant key, its reference)
        self._writers: dict[bytes, _Writer] = {}
        # (tenant, ref, wrapped DEK) -> the DEK's cipher objects (built once, reused by every open)
        self._deks: OrderedDict[tuple[bytes, bytes, bytes], _Dek] = OrderedDict()

    def __repr__(self) -> str:
        return f"RecordCipher(tenants={len(self._refs)}, cached_deks={len(self._deks)})"

    # --- keys ----------------------------------------------------------------------------------

    def _tenant_ref(self, tenant: bytes, create: bool) -> tuple[bytes, bytes] | None:
        """``(tenant key, reference)`` from the callable, or None (and the tenant's DEKs dropped)."""
        if not isinstance(tenant, bytes) or len(tenant) != TENANT_BYTES:
            raise ValueError(f"a tenant id is {TENANT_BYTES} bytes")
        try:
            key = self._keys(tenant, create)
        except Exception as e:  # the callable's fault is a missing key to both callers
            log.warning("tenant %s: key lookup failed (%s)", tenant.hex(), type(e).__name__)
            key = None
        with self._lock:
            known = self._refs.get(tenant)
            if key is not None and known is not None and hmac.compare_digest(known[0], key):
                return known
            if known is not None:  # erased, or replaced by a new key: its DEKs are dead
                self._drop_locked(tenant)
            if key is None:
                return None
            if len(key) != TENANT_KEY_BYTES:
                log.error("tenant %s: key lookup returned %d bytes", tenant.hex(), len(key))
                return None
            entry = (bytes(key), key_ref(key))
            self._refs[tenant] = entry
            return entry

    def _drop_locked(self, tenant: bytes) -> None:
        self._refs.pop(tenant, None)
        self._writers.pop(tenant, None)
        for k in [k for k in self._deks if k[0] == tenant]:
            del self._deks[k]

    def _cache_dek_locked(self, k: tuple[bytes, bytes, bytes], dek: _Dek) -> None:
        self._deks[k] = dek
        self._deks.move_to_end(k)
        while len(self._deks) > self._dek_cache_size:
            self._deks.popitem(last=False)

    def _take_nonce(self, tenant: bytes, key: bytes, ref: bytes) -> tuple[_Writer, bytes]:
        """The tenant's writer and a nonce never used under its DEK (a fresh DEK when needed)."""
        while True:
            with self._lock:
                w = self._writers.get(tenant)
                if w is None or w.ref != ref:
                    dek = os.urandom(DEK_BYTES)
                    wrapped = aes_key_wrap(key, dek)
                    head = bytes([SEAL_FORMAT, 0, 0, 0]) + ref + wrapped
                    objs = _Dek.of(dek)
                    w = _Writer(ref, objs, head, _AAD_LABEL + tenant + head, 0, threading.Lock())
                    self._writers[tenant] = w
                    self._cache_dek_locked((tenant, ref, wrapped), objs)
            with w.lock:
                n = w.next_nonce
                if n < self._records_per_dek:
                    w.next_nonce = n + 1
                    return w, n.to_bytes(NONCE_BYTES, "big")
            with self._lock:  # this DEK is used up: retire it (once) and loop for a fresh one
                if self._writers.get(tenant) is w:
                    del self._writers[tenant]

    # --- hot path ------------------------------------------------------------------------------

    def batch(self) -> CipherBatch:
        """A ``CipherBatch`` over this cipher, for one thread and one batch of records."""
        return CipherBatch(self)

    def seal(self, tenant: bytes, aad: bytes, payload: memoryview | bytearray,
             out: memoryview | bytearray | None = None) -> bytes:
        """Encrypt ``payload`` (a writable, contiguous buffer) in place, or into ``out``, which is
        then only read: one pass over the bytes instead of a copy and a pass; return its seal.

        ``out`` is as long as ``payload``, or longer: then up to 16 bytes after the payload's length
        are scratch (the AEAD call writes the tag there; their old content is lost) and the seal is
        one call of the DEK's ``AESGCM``. The ciphertext and the seal are the same either way.

        Raises:
            TenantKeyUnavailable: no tenant key; ``payload`` (and ``out``) are unchanged.
            ValueError: a tenant id that is not 8 bytes; an ``out`` shorter than ``payload``.
        """
        return self._seal(self._tenant_ref(tenant, True), tenant, aad, payload, out)

    def open(self, tenant: bytes, aad: bytes, payload: memoryview | bytearray, seal: bytes, *,
             lent: int = 0) -> bool:
        """Decrypt ``payload`` in place. True if it is authentic plaintext now. False on a malformed
        seal, no tenant key, another tenant-key generation or an unwrappable DEK (``payload``
        untouched, still ciphertext), or a failed tag (``payload`` zeroed): never unauthenticated
        plaintext. Only a tenant id that is not 8 bytes raises.

        ``lent``: the last ``lent`` bytes of ``payload`` are not ciphertext but bytes the caller lends
        (no other thread may use them meanwhile); with 16 or more, the tag goes there for one
        ``AESGCM.decrypt_into`` and they hold what they held before when this returns."""
        return self._open(self._tenant_ref(tenant, False), tenant, aad, payload, seal, lent)

    def _seal(self, got: tuple[bytes, bytes] | None, tenant: bytes, aad: bytes,
              payload: memoryview | bytearray, out: memoryview | bytearray | None) -> bytes:
        if got is None:
            raise TenantKeyUnavailable(f"tenant {tenant.hex()}: no key to seal with")
        key, ref = got
        if out is None:
            w, nonce = self._take_nonce(tenant, key, ref)
            enc = Cipher(w.dek.algo, modes.GCM(nonce)).encryptor()
            enc.authenticate_additional_data(w.aad_head + aad)
            _crypt_in_place(enc, _bytes_view(payload))
            enc.finalize()
            return w.head + nonce + enc.tag
        src = memoryview(payload).cast("B")
        dst = _bytes_view(out)
        n = len(src)
        if len(dst) < n:
            raise ValueError("out must be at least as long as the payload")
        w, nonce = self._take_nonce(tenant, key, ref)
        if len(dst) >= n + TAG_BYTES:  # room for the tag after the ciphertext: one AEAD call
            w.dek.aead.encrypt_into(nonce, src, w.aad_head + aad, dst[: n + TAG_BYTES])
            return w.head + nonce + bytes(dst[n : n + TAG_BYTES])
        enc = Cipher(w.dek.algo, modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(w.aad_head + aad)
        _crypt_into(enc, src, dst[:n])
        enc.finalize()
        return w.head + nonce + enc.tag

    def _open(self, key_and_ref: tuple[bytes, bytes] | None, tenant: bytes, aad: bytes,
              payload: memoryview | bytearray, seal: bytes, lent: int = 0) -> bool:
        if key_and_ref is None or len(seal) != SEAL_BYTES or seal[0] != SEAL_FORMAT or any(seal[1:4]):
            return False
        key, ref = key_and_ref
        seal = bytes(seal)
        if seal[_OFF_REF:_OFF_DEK] != ref:
            return False
        wrapped = seal[_OFF_DEK:_OFF_NONCE]
        dek = self._dek(tenant, ref, key, wrapped)
        if dek is None:
            return False
        whole = _bytes_view(payload)
        if not 0 <= lent <= len(whole):
            raise ValueError("lent must be within the payload buffer")
        n = len(whole) - lent
        mv = whole[:n]
        full_aad = _AAD_LABEL + tenant + seal[:_AUTH] + aad
        if lent >= TAG_BYTES:  # ciphertext | tag in one buffer: one AEAD call, in place
            opened = _open_lent(dek.aead, seal, full_aad, whole, n)
            if opened is not None:
                return opened
        dec = Cipher(dek.algo, modes.GCM(seal[_OFF_NONCE:_OFF_TAG], seal[_OFF_TAG:])).decryptor()
        dec.authenticate_additional_data(full_aad)
        _crypt_in_place(dec, mv)
        try:
            dec.finalize()
        except InvalidTag:
            mv[:] = bytes(n)
            return False
        return True

    def _dek(self, tenant: bytes, ref: bytes, key: bytes, wrapped: bytes) -> _Dek | None:
        k = (tenant, ref, wrapped)
        with self._lock:
            dek = self._deks.get(k)
            if dek is not None:
                self._deks.move_to_end(k)
                return dek
        try:
            dek = _Dek.of(aes_key_unwrap(key, wrapped))
        except InvalidUnwrap:
            return None
        with self._lock:
            self._cache_dek_locked(k, dek)
        return dek


class CipherBatch:
    """``RecordCipher.seal`` and ``open`` for one batch of records (a write or read batch of a few
    MiB) on one thread: each tenant's key is looked up once per batch instead of once per record,
    everything else (nonces, DEKs, checks) is the cipher's. A batch is short-lived by contract
    (milliseconds): a key erased while it runs stops opening with the next batch, well inside the
    key store's ``key_cache_s``. Not thread-safe; use one per thread and batch."""

    __slots__ = ("_cipher", "_refs")

    def __init__(self, cipher: RecordCipher) -> None:
        self._cipher = cipher
        self._refs: dict[tuple[bytes, bool], tuple[bytes, bytes] | None] = {}

    def _ref(self, tenant: bytes, create: bool) -> tuple[bytes, bytes] | None:
        k = (tenant, create)
        if k in self._refs:
            return self._refs[k]
        got = self._refs[k] = self._cipher._tenant_ref(tenant, create)
        return got

    def seal(self, tenant: bytes, aad: bytes, payload: memoryview | bytearray,
             out: memoryview | bytearray | None = None) -> bytes:
        """``RecordCipher.seal``."""
        return self._cipher._seal(self._ref(tenant, True), tenant, aad, payload, out)

    def open(self, tenant: bytes, aad: bytes, payload: memoryview | bytearray, seal: bytes, *,
             lent: int = 0) -> bool:
        """``RecordCipher.open``."""
        return self._cipher._open(self._ref(tenant, False), tenant, aad, payload, seal, lent)


def _open_lent(aead: AESGCM, seal: bytes, full_aad: bytes, whole: memoryview, n: int) -> bool | None:
    """Open ``whole[:n]`` in place with one AEAD call, the tag put in the lent ``whole[n:n + 16]``
    for the call (their bytes put back after it). None if this ``cryptography`` refuses the buffers
    (nothing was decrypted: the caller takes the GCM context path)."""
    mv = whole[:n]
    room = whole[n : n + TAG_BYTES]
    kept = bytes(room)
    room[:] = seal[_OFF_TAG:]
    try:
        aead.decrypt_into(seal[_OFF_NONCE:_OFF_TAG], whole[: n + TAG_BYTES], full_aad, mv)
    except InvalidTag:
        mv[:] = bytes(n)  # never leave unauthenticated plaintext
        return False
    except (TypeError, ValueError):  # e.g. a release that will not decrypt over its input
        return None
    finally:
        room[:] = kept
    return True


def _bytes_view(payload: memoryview | bytearray) -> memoryview:
    mv = memoryview(payload)
    if mv.readonly:
        raise TypeError("payload must be a writable buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _exact_in_place_ok() -> bool:
    """Whether this ``cryptography`` lets a GCM context's ``update_into`` write over its input
    exactly (newer releases; older ones want 15 spare output bytes and allow any overlap)."""
    buf = memoryview(bytearray(32))
    ctx = Cipher(algorithms.AES(bytes(32)), modes.GCM(bytes(NONCE_BYTES))).encryptor()
    try:
        ctx.update_into(buf, buf)
    except ValueError:
        return False
    return True


_EXACT_IN_PLACE = _exact_in_place_ok()


def _crypt_into(ctx: Any, src: memoryview, dst: memoryview) -> None:
    """Run a GCM encryptor from ``src`` into ``dst`` (same length, not overlapping)."""
    if len(src) != len(dst):
        raise ValueError("out must be as long as the payload")
    if _EXACT_IN_PLACE:
        ctx.update_into(src, dst)
        return
    dst[:] = src  # releases that want spare output bytes: copy, then the in-place path
    _crypt_in_place(ctx, dst)


def _crypt_in_place(ctx: Any, mv: memoryview) -> None:
    """Run a GCM en/decryptor over ``mv`` in place (GCM is a stream mode: output length = input
    length). Where ``update_into`` insists on 15 spare output bytes, all but the last 15 bytes go
    in place with the next 15 bytes of the same buffer as the spare, and the tail goes through a
    small scratch buffer."""
    if _EXACT_IN_PLACE:
        ctx.update_into(mv, mv)
        return
    n = len(mv)
    body = max(0, n - _TAIL)
    if body:
        ctx.update_into(mv[:body], mv[:body + _TAIL])
    if n > body:
        scratch = bytearray(2 * _TAIL)
        done = ctx.update_into(mv[body:], scratch)
        mv[body:] = scratch[:done]
