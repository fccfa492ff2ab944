"""One typed, validated settings object for the whole store.

Sources, highest priority first: explicit keyword arguments / a mapping (vLLM's
``kv_connector_extra_config``), environment variables ``DYN_TIERED_KV_<FIELD>``, a YAML file
(``DYN_TIERED_KV_CONFIG_FILE`` or ``TieredKVConfig.from_yaml``), then the defaults below.
One rule for every source: an unknown name (keyword, ``DYN_TIERED_KV_*`` variable, YAML key) is
refused with a ``ConfigError`` naming it and the closest known name; every error names its field
and where its value came from (the caller's mapping, the env var, the YAML file) and fits on one
line; secrets never appear in ``repr``. Every ``*_bytes`` setting takes a size (``16Gi``,
``512MiB``, ``100GB``: ``sizes.py``) or an integer. Parse once, at start; nothing deeper in
the code reads raw dicts.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ..errors import ConfigError
from .sizes import parse_size

ENV_PREFIX = "DYN_TIERED_KV_"
ENV_CONFIG_FILE = ENV_PREFIX + "CONFIG_FILE"
_yaml_file: ContextVar[Path | None] = ContextVar("_yaml_file", default=None)
# what to call the keyword values in an error: one name for all, or one per setting
_given_as: ContextVar[str | Mapping[str, str]] = ContextVar("_given_as", default="keyword arguments")
GiB = 1 << 30
MiB = 1 << 20
MAX_TENANT_QUOTAS = 10_000  # tenants named in tenant_quotas (a settings file, not a database)


class TieredKVConfig(BaseSettings):
    """Settings for the tiers, staging, admission and observability."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True)

    # --- identity ------------------------------------------------------------------------
    tenant_salt: SecretStr = Field(SecretStr(""), description="mixed into every key; tenants never share KV")
    model_id: str | None = Field(None, description="override the engine's model name in the namespace")

    # --- tenants (a request's cache_salt names its tenant; docs/TENANTS.md) ---------------------
    tenant_default_share: float = Field(
        1.0, gt=0, le=1, allow_inf_nan=False, description="share of each tier's capacity a tenant may hold unless "
        "tenant_quotas names it; past it the tenant evicts its own blocks; 1.0: no quota"
    )
    encryption: Literal["off", "on"] = Field(
        "off", description="seal every record at rest (SSD, objects) with AES-256-GCM under per-tenant keys "
        "(docs/ENCRYPTION.md); needs a key-encryption key source"
    )
    encryption_keys: str | None = Field(
        None, description="where the key-encryption keys are: file:///path (text or JSON), env:NAME, or dir:///path "
        "(a mounted Kubernetes Secret, one file per version); None: env:DTKV_TENANT_KEKS"
    )
    encryption_key_cache_s: float = Field(
        60.0, ge=0, allow_inf_nan=False, description="how long a node keeps using a tenant key it read: the bound "
        "on how long an erased tenant stays readable on other nodes"
    )
    tenant_quotas: dict[str, dict[Literal["host", "ssd", "object"], int | float | str]] = Field(
        default_factory=dict, max_length=MAX_TENANT_QUOTAS, description="per-tenant limits, {tenant: {tier: bytes, "
        "'40GiB' or a share <= 1.0}}; a tenant is its name (cache_salt), 'id:<16 hex>' or 'default'"
    )

    # --- G2 host tier -----------------------------------------------------------------------
    host_capacity_bytes: int = Field(2 * GiB, ge=0, description="host DRAM for hot blocks; 0 disables")
    host_ttl_s: float = Field(900.0, gt=0, description="host tier retention (minutes)")

    # --- G3 SSD tier --------------------------------------------------------------------------
    ssd_dir: Path | None = Field(None, description="local NVMe directory; None disables the SSD tier")
    ssd_capacity_bytes: int = Field(64 * GiB, gt=0, description="SSD bytes this worker may fill under ssd_dir; "
                                    "older segments are evicted beyond it")
    ssd_segment_bytes: int = Field(256 * MiB, ge=1 * MiB, description="size of one SSD segment file, the unit of "
                                   "eviction and upload (at most a quarter of ssd_capacity_bytes)")
    ssd_io: Literal["auto", "nixl", "odirect", "buffered"] = Field(
        "auto", description="SSD I/O path: auto (NIXL POSIX if it passes its probe, else O_DIRECT), nixl, odirect, "
        "or buffered (filesystems that refuse O_DIRECT fall back to it)"
    )
    ssd_ttl_s: float = Field(24 * 3600.0, gt=0, description="SSD retention (hours)")
    ssd_seal_idle_s: float = Field(5.0, gt=0, description="seal the open segment after this idle time")
    ssd_allow_evict_unflushed: bool = Field(False, description="drop segments not yet in the object tier")
    ssd_gpu_direct: Literal["auto", "off"] = Field(
        "auto", description="GPUDirect Storage (NIXL GDS_MT) between GPU memory and SSD when the start-up probe passes"
    )

    # --- G4 object tier -----------------------------------------------------------------------
    object_url: str | None = Field(None, description="s3://bucket/prefix or file:///dir; None disables")
    object_ttl_s: float = Field(14 * 24 * 3600.0, gt=0, description="object retention (days to weeks)")
    object_capacity_bytes: int = Field(100 * 1024 * GiB, gt=0, description="bound on live object bytes")
    object_refresh_s: float | None = Field(30.0, gt=0, description="re-list manifests to see other nodes' blocks")
    s3_endpoint_url: str | None = Field(
        None, description="S3 server, e.g. http://rgw:7480; None: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS"
    )
    s3_region: str | None = Field(None, description="signing region; None: AWS_REGION, else us-east-1")
    s3_access_key: SecretStr | None = Field(None, description="with s3_secret_key; None: the AWS credential chain")
    s3_secret_key: SecretStr | None = Field(None, description="with s3_access_key; None: the AWS credential chain")
    s3_verify_tls: bool = Field(True, description="check the S3 server's TLS certificate")
    s3_addressing_style: Literal["path", "virtual", "auto"] = Field(
        "path", description="path (RGW, MinIO by IP) or virtual-hosted bucket names"
    )
    s3_part_bytes: int = Field(8 * MiB, ge=5 * MiB, description="multipart upload part size")
    s3_max_concurrency: int = Field(8, ge=1, le=256, description="parts in flight per upload")
    s3_read_concurrency: int = Field(
        8, ge=1, le=256, description="object tier (S3 or file://): ranged GETs in flight at once (manifest fetches: "
        "at least 16); raise it when each GET waits on the server (HDD-backed S3: a seek per GET), lower it for a "
        "small gateway"
    )
    s3_direct_reads: bool = Field(
        True, description="ranged GETs received straight into staging memory (false: through aiobotocore)"
    )
    s3_first_byte_timeout_s: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="longest wait for a ranged GET's first response byte before "
        "the attempt is given up and retried; a read waits at most twice this in all, over its retries and hedges "
        "(a stalled gateway then costs a restore about twice this, and it is recomputed)"
    )
    s3_hedge_reads: bool = Field(
        True, description="send a second identical ranged GET when the first has not answered after the p99 "
        "first-byte latency of recent GETs (at least 50 ms); the first to answer is used, the other closed"
    )
    flush_queue_segments: int = Field(16, ge=1, description="bounded flusher queue")

    # --- staging, admission, engine-facing -----------------------------------------------------
    staging_slab_bytes: int = Field(
        32 * MiB, ge=64 * 1024, description="size of one host staging slab (locked in memory, pinned for CUDA): "
        "records move between the engine and the tiers through these"
    )
    staging_slabs: int = Field(8, ge=1, description="number of host staging slabs")
    gpu_staging_slabs: int = Field(
        2, ge=1, description="GPU-direct only: device slabs of staging_slab_bytes each, taken from GPU memory"
    )
    admission: Literal["always", "second_hit"] = Field(
        "always", description="always: every offloaded block goes to every tier; second_hit: to SSD and objects "
        "only once the block was seen twice"
    )
    min_prefix_blocks: int = Field(1, ge=1, description="only offload prefixes at least this long")
    max_pending_offloads: int = Field(64, ge=1, description="queued offload batches before dropping")
    retain_max_share: float = Field(
        0.5, ge=0, le=1, description="share of each tier kv.retain may protect; beyond it the lowest priority yields"
    )
    expire_interval_s: float = Field(
        300.0, ge=0, allow_inf_nan=False, description="seconds between the store's expiry passes: retained blocks "
        "whose expiry passed leave every tier (at most 1 GiB per pass); 0: off"
    )
    load_timeout_s: float = Field(30.0, gt=0, description="deadline of one restore; blocks not restored are recomputed")
    recompute_tokens_per_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="this engine's prefill rate: a restore then waits on the "
        "object tier at most as long as recomputing its tokens would take (at least 0.2 s), and is a miss at once "
        "when recent GETs say its bytes cannot arrive in time; None: only load_timeout_s bounds it"
    )
    load_async: bool = Field(
        True, description="restore in the background while the batch keeps decoding (vLLM WAITING_FOR_REMOTE_KVS)"
    )
    sync_restore_max_tokens: int = Field(
        4096, ge=0, description="with load_async: a restore of at most this many tokens on an otherwise idle engine "
        "(no other request alive, no restore in flight) runs synchronously in the step that schedules it, which saves "
        "the steps between its end and the request running; 0: always asynchronous"
    )
    restore_cpu_share: float = Field(
        0.2, ge=0, le=1, description="CPU engines: while other requests run a forward, a restore's verify+scatter "
        "takes at most this share of each engine step (the forward keeps every core busy, so restore CPU stretches "
        "their decode steps); 0: unpaced. Idle steps never limit it"
    )
    cache_reset: Literal["new_epoch", "keep"] = Field(
        "new_epoch", description="on vLLM's connector cache reset (weight update, and every sleep/pause with "
        "clear_cache): new_epoch makes all stored KV unreachable; keep ignores it (only if weights never change "
        "in place)"
    )

    # --- observability ---------------------------------------------------------------------------
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus metrics on this port + TP rank (0: any free port)"
    )

    @field_validator("*", mode="before")
    @classmethod
    def _parse_sizes(cls, v: Any, info: ValidationInfo) -> Any:
        if info.field_name and info.field_name.endswith("_bytes") and isinstance(v, str):
            return parse_size(v)
        return v

    @field_validator("tenant_quotas")
    @classmethod
    def _check_tenant_quotas(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for tenant, limits in v.items():
            if not tenant:
                raise ValueError("tenant_quotas: an empty tenant name (write 'default' for the default tenant)")
            for tier, limit in limits.items():
                if isinstance(limit, float) and not 0.0 < limit <= 1.0:
                    raise ValueError(f"tenant_quotas[{tenant!r}][{tier!r}]: a share must be in (0, 1], got {limit}")
                if isinstance(limit, str):
                    parse_size(limit)
                elif isinstance(limit, int) and limit < 0:
                    raise ValueError(f"tenant_quotas[{tenant!r}][{tier!r}]: bytes must be >= 0")
        return v

    @field_validator("object_url")
    @classmethod
    def _check_object_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("s3://", "file://")):
            raise ValueError("must start with s3:// or file://")
        return v

    @model_validator(mode="after")
    def _check_cross_fields(self) -> TieredKVConfig:
        if self.host_capacity_bytes and self.host_capacity_bytes < self.staging_slab_bytes // 8:
            raise ValueError("host_capacity_bytes is too small to hold even a fraction of one staging slab")
        if self.object_url and self.object_url.startswith("s3://") and not self.object_url[5:].strip("/"):
            raise ValueError("object_url s3:// needs a bucket name")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ):
        return init_settings, env_settings, _YamlSource(settings_cls)

    # --- every way in turns a failure into one ConfigError line naming the field ---------------
    def __init__(self, **values: Any) -> None:
        # checked before pydantic runs: its own message for these is a multi-line ValidationError
        known = sorted(type(self).model_fields)
        problems = [p for k in values if not k.startswith("_")
                    for p in unknown_names([k], known, what="setting", where=source_of(k, values))]
        problems += _unknown_env()
        if problems:
            raise ConfigError("invalid dynamo-tiered-kv config: " + "; ".join(problems))
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(_describe(e, values)) from None

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any] | None = None, *, source: str | Mapping[str, str] = "kv_connector_extra_config"
    ) -> TieredKVConfig:
        """Build from a dict (e.g. ``kv_connector_extra_config``), env vars and the YAML file.

        ``source`` names the dict in errors: one name, or one per setting (``dtkv``: its flags)."""
        token = _given_as.set(source)
        try:
            return cls(**dict(data or {}))
        finally:
            _given_as.reset(token)

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], *, source: str | Mapping[str, str] = "keyword arguments", **overrides: Any
    ) -> TieredKVConfig:
        """Settings from a YAML file (ranked like ``DYN_TIERED_KV_CONFIG_FILE``: env vars override it)."""
        token = _yaml_file.set(Path(path))
        try:
            return cls.from_mapping(overrides, source=source)
        finally:
            _yaml_file.reset(token)

    def redacted(self) -> dict[str, Any]:
        """Settings as a plain dict with secrets masked (for logs and ``dtkv config``)."""
        return self.model_dump(mode="json")


class _YamlSource(PydanticBaseSettingsSource):
    """Values from the YAML file named by ``DYN_TIERED_KV_CONFIG_FILE`` (if set)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _yaml_file.get() or os.environ.get(ENV_CONFIG_FILE)
        return read_yaml(Path(path)) if path else {}


def unknown_names(names: Iterable[str], known: Sequence[str], *, what: str, where: str = "") -> list[str]:
    """One ``"NAME: unknown WHAT[ in WHERE] (did you mean X?)"`` per name not in ``known``."""
    known_set = set(known)
    out = []
    for name in sorted(set(names) - known_set):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append(f"{name}: unknown {what}{' in ' + where if where else ''}{hint}")
    return out


def _unknown_env() -> list[str]:
    known = [ENV_PREFIX + f.upper() for f in TieredKVConfig.model_fields] + [ENV_CONFIG_FILE]
    return unknown_names((k for k in os.environ if k.startswith(ENV_PREFIX)), known, what="environment setting")


def read_yaml(path: Path) -> dict[str, Any]:
    """The settings in a YAML file; unknown keys are refused here, naming the file."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        msg = " ".join(str(e).split())  # YAML errors span lines; an error here is one line
        raise ConfigError(f"cannot read config file {path}: {msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    problems = unknown_names(map(str, data), sorted(TieredKVConfig.model_fields), what="setting", where=str(path))
    if problems:
        raise ConfigError("invalid dynamo-tiered-kv config: " + "; ".join(problems))
    return data


def source_of(name: str, given: Mapping[str, Any]) -> str:
    """Where the value of setting ``name`` came from, by the precedence of the sources."""
    if name in given:
        label = _given_as.get()
        return label if isinstance(label, str) else label.get(name, "keyword arguments")
    env = ENV_PREFIX + name.upper()
    if env in os.environ:
        return env
    path = _yaml_file.get() or os.environ.get(ENV_CONFIG_FILE)
    if path:
        try:
            if name in read_yaml(Path(path)):
                return f"config file {path}"
        except ConfigError:
            pass
    return "default"


def _describe(e: ValidationError, given: Mapping[str, Any]) -> str:
    parts = []
    for err in e.errors():
        field = ".".join(str(x) for x in err["loc"]) or "<config>"
        msg = err["msg"] if err["type"] != "extra_forbidden" else "unknown setting"
        msg = " ".join(str(msg).split()).removeprefix("Value error, ")
        where = f" (from {source_of(str(err['loc'][0]), given)})" if err["loc"] else ""
        parts.append(f"{field}{where}: {msg}")
    return "invalid dynamo-tiered-kv config: " + "; ".join(parts)
