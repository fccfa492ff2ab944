"""Tenant ids: the opaque 8-byte tag every block carries (record header, indexes, manifests).

A tenant is what Dynamo calls ``x-tenant-id`` and hands vLLM as the request's ``cache_salt``; a
deployment without per-request salts is one tenant named by its ``tenant_salt``. Salts gate
sharing, so they are secrets: a tenant id is a keyed BLAKE2b digest of the tenant's name (keyed
by the deployment's ``tenant_salt``), never the name itself. An operator who knows a tenant's
name and the deployment's salt computes the same id (``dtkv tenants id NAME``); someone holding
only a disk or the bucket learns nothing but which blocks share a tenant.

``DEFAULT_TENANT`` (eight zero bytes) is the tenant of requests with no salt at all and of every
record written before records carried a tenant (docs/FORMAT.md: the field was reserved and zero).
A keyed digest is never all zeros in practice (2^-64), and ``tenant_id`` maps that case away.
"""

from __future__ import annotations

import hashlib
import re

TENANT_BYTES = 8
DEFAULT_TENANT = bytes(TENANT_BYTES)
_PERSON_NAME = b"dtkv-tenant-v1"  # a request's tenant name (cache salt)
_PERSON_DEPLOY = b"dtkv-tenant-d1"  # a deployment's own salt as its only tenant
_HEX = re.compile(r"[0-9a-f]{16}")


def _digest(person: bytes, key: bytes, value: str) -> bytes:
    d = hashlib.blake2b(value.encode(), digest_size=TENANT_BYTES, key=key[:64], person=person).digest()
    return d if d != DEFAULT_TENANT else b"\x00" * (TENANT_BYTES - 1) + b"\x01"


def tenant_id(name: str | None, *, deployment_salt: str = "") -> bytes:
    """The tenant id of a request whose tenant name (``cache_salt``) is ``name``.

    No name: the deployment's tenant (a digest of its ``tenant_salt``), or ``DEFAULT_TENANT`` when
    the deployment has no salt either. Long salts are hashed into the key (BLAKE2b keys are at
    most 64 bytes)."""
    key = deployment_salt.encode()
    if len(key) > 64:
        key = hashlib.blake2b(key, digest_size=64).digest()
    if name:
        return _digest(_PERSON_NAME, key, name)
    if deployment_salt:
        return _digest(_PERSON_DEPLOY, key, deployment_salt)
    return DEFAULT_TENANT


def tenant_hex(tenant: bytes) -> str:
    """How tenants are written in object names, metrics, logs and command output."""
    if len(tenant) != TENANT_BYTES:
        raise ValueError(f"a tenant id is {TENANT_BYTES} bytes, got {len(tenant)}")
    return tenant.hex()


def parse_tenant(text: str, *, deployment_salt: str = "") -> bytes:
    """A tenant named on a command line or in settings: ``id:<16 hex digits>`` is an id as
    written by ``tenant_hex``, ``default`` the default tenant; anything else is a tenant name
    (a ``cache_salt``), digested with the deployment's salt."""
    if text == "default":
        return DEFAULT_TENANT
    if text.startswith("id:"):
        h = text[3:].lower()
        if not _HEX.fullmatch(h):
            raise ValueError(f"tenant id {text!r} must be 'id:' followed by 16 hex digits")
        return bytes.fromhex(h)
    if not text:
        raise ValueError("an empty tenant name; write 'default' for the default tenant")
    return tenant_id(text, deployment_salt=deployment_salt)
