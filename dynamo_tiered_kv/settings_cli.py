"""Settings for the ``dtkv`` commands: the connector's own ``TieredKVConfig``, from the same
sources (``DYN_TIERED_KV_*`` env vars, the YAML file of ``--config`` or
``DYN_TIERED_KV_CONFIG_FILE``), plus flags for the common ones, and the origin of each value, so
that a failed S3 call can say which endpoint and credentials it used and where they came from.

The old ``DTKV_S3_*`` variables still work (scripts and CI set them) but warn once each.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ENV_CONFIG_FILE, ENV_PREFIX, TieredKVConfig, read_yaml
from .errors import ConfigError

# deprecated variable -> the setting it stands for
DEPRECATED_ENV = {
    "DTKV_S3_ENDPOINT": "s3_endpoint_url",
    "DTKV_S3_ACCESS_KEY": "s3_access_key",
    "DTKV_S3_SECRET_KEY": "s3_secret_key",
    "DTKV_S3_REGION": "s3_region",
}
# settings with a flag of their own (name -> flag); any other one: --set NAME=VALUE
_FLAGS = {
    "s3_endpoint_url": "--s3-endpoint-url",
    "s3_region": "--s3-region",
    "s3_addressing_style": "--s3-addressing-style",
    "s3_verify_tls": "--no-s3-verify-tls",
}
_warned: set[str] = set()


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The settings flags every non-bench command takes."""
    fields = TieredKVConfig.model_fields
    g = p.add_argument_group(
        "settings", "the connector's settings: same names, DYN_TIERED_KV_<NAME> env vars and YAML file; "
        "flags win over env, env over the file"
    )
    g.add_argument("--config", metavar="FILE", type=Path,
                   help=f"YAML settings file, as the connector reads it (default ${ENV_CONFIG_FILE})")
    g.add_argument("--set", metavar="NAME=VALUE", action="append", default=[], dest="settings",
                   help="any setting by name, repeatable (e.g. --set s3_part_bytes=16Mi)")
    g.add_argument("--s3-endpoint-url", metavar="URL", help=fields["s3_endpoint_url"].description)
    g.add_argument("--s3-region", metavar="REGION", help=fields["s3_region"].description)
    g.add_argument("--s3-addressing-style", choices=["path", "virtual", "auto"],
                   help=fields["s3_addressing_style"].description)
    g.add_argument("--no-s3-verify-tls", dest="s3_verify_tls", action="store_false", default=None,
                   help="do not check the S3 server's TLS certificate")


@dataclass
class Settings:
    """The resolved settings and, per setting given anywhere, where its value came from."""

    config: TieredKVConfig
    origin: dict[str, str] = field(default_factory=dict)

    def origin_of(self, name: str) -> str:
        return self.origin.get(name, "default")

    def endpoint(self) -> tuple[str, str]:
        """The S3 endpoint the backend will use, and where it came from (the same fallbacks)."""
        if self.config.s3_endpoint_url:
            return self.config.s3_endpoint_url, self.origin_of("s3_endpoint_url")
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(var):
                return os.environ[var], var
        return "AWS", "no s3_endpoint_url set"

    def s3_kwargs(self) -> dict[str, Any]:
        """``backend_from_url`` arguments, built like the connector's (factory.py)."""
        c = self.config
        return {
            "endpoint_url": c.s3_endpoint_url,
            "region": c.s3_region,
            "access_key": c.s3_access_key.get_secret_value() if c.s3_access_key else None,
            "secret_key": c.s3_secret_key.get_secret_value() if c.s3_secret_key else None,
            "verify_tls": c.s3_verify_tls,
            "addressing_style": c.s3_addressing_style,
            "part_bytes": c.s3_part_bytes,
            "max_concurrency": c.s3_max_concurrency,
            "read_concurrency": c.s3_read_concurrency,
            "direct_reads": c.s3_direct_reads,
        }


def load(args: argparse.Namespace) -> Settings:
    """Settings from flags (``add_arguments``), env vars (new and deprecated) and the YAML file."""
    overrides: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for item in getattr(args, "settings", None) or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects NAME=VALUE, got {item!r}")
        overrides[name.strip()], origin[name.strip()] = value, f"--set {name.strip()}"
    for name, flag in _FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            overrides[name], origin[name] = value, flag
    for name in TieredKVConfig.model_fields:
        if name not in overrides and env_name(name) in os.environ:
            origin[name] = env_name(name)
    for old, name in DEPRECATED_ENV.items():
        value = os.environ.get(old)
        if not value or name in origin:
            continue
        if old not in _warned:
            _warned.add(old)
            print(f"dtkv: warning: {old} is deprecated, use {env_name(name)}", file=sys.stderr)
        overrides[name], origin[name] = value, f"{old} (deprecated)"
    path = getattr(args, "config", None) or os.environ.get(ENV_CONFIG_FILE)
    given = {name: origin[name] for name in overrides}  # how errors name the flags' values
    if not path:
        return Settings(TieredKVConfig.from_mapping(overrides, source=given), origin)
    path = Path(path)
    for name in read_yaml(path):
        origin.setdefault(str(name), f"config file {path}")
    return Settings(TieredKVConfig.from_yaml(path, source=given, **overrides), origin)


def describe_s3_failure(url: str, settings: Settings, exc: BaseException) -> str:
    """One line: what could not be reached, with which settings from where, why, and what to do."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    reason = " ".join(str(root).split()) or type(root).__name__
    if not url.startswith("s3://"):
        return f"cannot reach {url}: {reason}"
    endpoint, endpoint_from = settings.endpoint()
    used = [f"s3_endpoint_url from {endpoint_from}" if endpoint != "AWS" else endpoint_from]
    if settings.config.s3_region:
        used.append(f"s3_region from {settings.origin_of('s3_region')}")
    if settings.config.s3_access_key:
        used.append(f"s3_access_key from {settings.origin_of('s3_access_key')}")
    else:
        used.append("credentials from the AWS chain")
    name = type(root).__name__
    code = ""
    response = getattr(root, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        hint = (f"set s3_access_key/s3_secret_key ({env_name('s3_access_key')}/{env_name('s3_secret_key')}, "
                "the --config file or kv_connector_extra_config) or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
        hint = "check s3_access_key/s3_secret_key and the bucket policy"
    elif code == "NoSuchBucket":
        hint = "create the bucket first: the store and dtkv never create buckets"
    elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") or isinstance(
        root, (ConnectionError, TimeoutError)
    ):
        hint = f"check s3_endpoint_url (--s3-endpoint-url or {env_name('s3_endpoint_url')}) and the network"
    else:
        hint = ""
    return f"cannot reach {url} at {endpoint} ({'; '.join(used)}): {reason}" + (f" — {hint}" if hint else "")
