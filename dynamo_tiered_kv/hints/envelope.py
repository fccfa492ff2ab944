"""The KV hints envelope, and where a request carries it.

Wire format (vLLM ``vllm.v1.kv_hints.KvHintsEnvelope``, Dynamo ``KvHint``)::

    {"protocol_version": str, "message_id": str,
     "actions": [{"action_id": str, "action_type": str, "action_version": str, "payload": {...}}]}

Two transports carry it:

* ``request.kv_hints`` (vLLM >= 0.33): a ``KvHintsEnvelope`` (msgspec struct) or a dict;
* ``kv_transfer_params["kv_hints"]`` (vLLM 0.31/0.32 through the connector's transfer params),
  or ``kv_transfer_params["kv_hint"]`` (the key Dynamo 1.6's router writes): a dict or JSON text.

``request.kv_hints`` wins when both are present: the same envelope is often forwarded on both,
and reading it twice would apply its actions twice.

An envelope whose frame is unusable (not an object, ``actions`` not a list, a non-string
version or id) is *malformed*: the reader gets ``MalformedEnvelope`` and the request goes on
without hints. An action with a bad frame is kept as ``HintAction`` with ``frame_error`` set, so
that only that action is rejected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .limits import MAX_ENVELOPE_ACTIONS, MAX_ENVELOPE_JSON_BYTES

TRANSFER_PARAMS_KEYS = ("kv_hints", "kv_hint")


class MalformedEnvelope(ValueError):
    """The envelope's frame is unusable; ``code`` is a fixed reason, safe as a metric label."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


class HintRejected(ValueError):
    """One action is invalid; only that action is dropped. ``code`` is a fixed reason."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


@dataclass(frozen=True, slots=True)
class HintAction:
    """One action. ``frame_error`` names what was wrong with its frame (then it is rejected)."""

    action_id: str
    action_type: str
    action_version: str
    payload: Mapping[str, Any]
    frame_error: str | None = None

    @property
    def major_version(self) -> int | None:
        head = self.action_version.split(".", 1)[0]
        return int(head) if head.isdecimal() else None  # as vLLM reads it


@dataclass(frozen=True, slots=True)
class HintEnvelope:
    protocol_version: str
    message_id: str
    actions: tuple[HintAction, ...]
    dropped_actions: int = 0  # actions past MAX_ENVELOPE_ACTIONS, not looked at


def _field(obj: object, name: str) -> Any:
    """``obj[name]`` for mappings, ``obj.name`` for structs (vLLM's msgspec types); None if absent."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _action(raw: object) -> HintAction:
    if not isinstance(raw, Mapping) and not hasattr(raw, "action_type"):
        return HintAction("", "", "", {}, frame_error="action")
    ident, kind, version, payload = (_field(raw, n) for n in ("action_id", "action_type", "action_version", "payload"))
    texts = (ident, kind, version)
    if not all(isinstance(t, str) for t in texts):
        return HintAction(*(t if isinstance(t, str) else "" for t in texts), {}, frame_error="action")
    if not isinstance(payload, Mapping):
        return HintAction(ident, kind, version, {}, frame_error="payload")
    return HintAction(ident, kind, version, payload)


def coerce_envelope(raw: object) -> HintEnvelope:
    """Read an envelope from a dict, JSON text, or an object with the envelope's attributes.

    Raises:
        MalformedEnvelope: the frame is unusable (see the module docstring).
    """
    if isinstance(raw, (str, bytes, bytearray)):
        if len(raw) > MAX_ENVELOPE_JSON_BYTES:
            raise MalformedEnvelope("too_large", f"envelope JSON of {len(raw)} bytes")
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise MalformedEnvelope("json", f"envelope is not JSON: {e}") from None
    if not isinstance(raw, Mapping) and not hasattr(raw, "actions"):
        raise MalformedEnvelope("not_object", f"envelope is a {type(raw).__name__}")
    version, message_id, actions = (_field(raw, n) for n in ("protocol_version", "message_id", "actions"))
    if not isinstance(version, str):
        raise MalformedEnvelope("protocol_version", "protocol_version must be a string")
    if not isinstance(message_id, str):
        raise MalformedEnvelope("message_id", "message_id must be a string")
    if not isinstance(actions, (list, tuple)):
        raise MalformedEnvelope("actions", "actions must be a list")
    kept = actions[:MAX_ENVELOPE_ACTIONS]
    return HintEnvelope(version, message_id, tuple(_action(a) for a in kept), len(actions) - len(kept))


def raw_envelope(request: object = None, kv_transfer_params: object = None) -> object | None:
    """The envelope a request carries, unparsed, or None.

    ``request``: an engine request (``kv_hints``, else ``kv_transfer_params`` is looked at).
    ``kv_transfer_params``: the transfer params alone, when there is no request object.
    Only reads attributes and keys; ``read_hints`` turns anything these raise into a malformed
    envelope.
    """
    typed = getattr(request, "kv_hints", None) if request is not None else None
    if typed is not None:
        return typed
    params = kv_transfer_params
    if params is None and request is not None:
        params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, Mapping):
        for key in TRANSFER_PARAMS_KEYS:
            found = params.get(key)
            if found is not None:
                return found
    return None
