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

from ..errors import ConfigError
from .settings import ENV_CONFIG_FILE, ENV_PREFIX, TieredKVConfig, read_yaml

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


# --- the reference table of every setting (docs/CONFIG.md) -------------------------------------------
TABLE_BEGIN = ("<!-- BEGIN settings table: generated from config/settings.py by "
               "`python -m dynamo_tiered_kv.config.settings_cli --write docs/CONFIG.md` -->")
TABLE_END = "<!-- END settings table -->"


def _human_size(n: int) -> str:
    for unit, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}B"
    return str(n)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _human_seconds(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n and s % n == 0:
            return f"{_number(s)} ({_number(s / n)} {unit})"
    return _number(s)


def _default_text(name: str, value: Any) -> str:
    if value is None:
        return "unset"
    if hasattr(value, "get_secret_value"):
        return "empty" if not value.get_secret_value() else "(secret)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if name.endswith("_bytes") and isinstance(value, int):
        return _human_size(value)
    if name.endswith("_s") and isinstance(value, (int, float)):
        return _human_seconds(float(value))
    return f"`{value}`"


def _values_text(name: str, annotation: Any, metadata: list[Any]) -> str:
    """What a value may be: the choices, or the kind and bounds."""
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = type(None) in typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return " / ".join(f"`{a}`" for a in args)
    base = args[0] if optional and len(args) == 1 else annotation
    if typing.get_origin(base) is dict:  # a map whose values are maps of named entries
        inner = typing.get_args(base)[1]
        names = typing.get_args(typing.get_args(inner)[0]) if typing.get_origin(inner) is dict else ()
        return "map: name -> {" + " / ".join(f"`{n}`" for n in names) + ": size or share}" if names else "map"
    kinds = {bool: "true / false", int: "integer", float: "number", str: "text", Path: "path"}
    kind = ("size" if name.endswith("_bytes") else "seconds" if name.endswith("_s") and base is float
            else kinds.get(base, "secret" if "Secret" in str(base) else str(base)))
    bounds = []
    for m in metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(m, attr, None)
            if bound is not None:
                bounds.append(f"{sign} {_human_size(bound) if kind == 'size' else _number(bound)}")
    text = kind + (" " + ", ".join(bounds) if bounds else "")
    return text + (", or unset" if optional else "")


def settings_table() -> str:
    """Markdown table of every ``TieredKVConfig`` setting: name, default, values, description.

    Generated from the settings model, so the reference in docs/CONFIG.md cannot leave one out."""
    rows = ["| setting | default | values | what it does |", "|---|---|---|---|"]
    for name, f in TieredKVConfig.model_fields.items():
        desc = " ".join((f.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {_default_text(name, f.get_default(call_default_factory=True))} | "
                    f"{_values_text(name, f.annotation, f.metadata)} | {desc} |")
    return "\n".join(rows)


def with_settings_table(doc: str) -> str:
    """``doc`` with the text between ``TABLE_BEGIN`` and ``TABLE_END`` replaced by ``settings_table()``."""
    begin, end = doc.find(TABLE_BEGIN), doc.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no settings table markers ({TABLE_BEGIN!r} ... {TABLE_END!r}) in the document")
    return doc[:begin] + TABLE_BEGIN + "\n" + settings_table() + "\n" + doc[end:]


if __name__ == "__main__":
    # python -m dynamo_tiered_kv.config.settings_cli                 print the table
    # python -m dynamo_tiered_kv.config.settings_cli --write FILE    rewrite the table between the markers in FILE
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        target = Path(sys.argv[2])
        target.write_text(with_settings_table(target.read_text()))
    elif len(sys.argv) == 1:
        print(settings_table())
    else:
        sys.exit("usage: python -m dynamo_tiered_kv.config.settings_cli [--write FILE]")
