"""Session flags a request's ``kv_transfer_params`` may carry (engine-neutral)."""

from __future__ import annotations

from collections.abc import Mapping

#: Dynamo's ``X-Dynamo-Session-Final`` header, as the frontend forwards it (any case)
SESSION_FINAL_KEYS = ("x-dynamo-session-final", "session_final")


def session_final(params: object) -> bool:
    """Whether the request is its session's last (its blocks are released and demoted after it)."""
    if not isinstance(params, Mapping):
        return False
    for k, v in params.items():
        if isinstance(k, str) and k.lower() in SESSION_FINAL_KEYS:
            return v is True or (isinstance(v, str) and v.lower() in ("1", "true", "yes"))
    return False
