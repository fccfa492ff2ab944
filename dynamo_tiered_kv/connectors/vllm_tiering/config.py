"""Settings of the secondary tier: the store's own settings language plus a few tier options.

vLLM passes every key of a ``secondary_tiers`` entry (except ``type``, ``module_path`` and
``backpressure``) to the tier's constructor, so a tier's keyword arguments are its config schema.
Here those keys are split in two: the handful this adapter owns (``TierOptions``) and everything
else, which must be a ``TieredKVConfig`` setting (``ssd_dir``, ``object_url``, ``tenant_salt``,
capacities...) and is validated by it, so an unknown or misspelt key fails at start with one
line that names it. ``DYN_TIERED_KV_*`` variables and the YAML file apply as for our connector.

One default differs from our connector: ``host_capacity_bytes`` is 0, since vLLM's own CPU tier
(``cpu_bytes_to_use``) is the host tier here; a second DRAM copy below it would only cost memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...config.settings import ENV_PREFIX, TieredKVConfig
from ...errors import ConfigError


@dataclass(frozen=True)
class TierOptions:
    """Tier-only options (never part of ``TieredKVConfig``)."""

    #: threads that run store and load jobs (the scheduler thread only enqueues)
    job_threads: int = 4
    #: how long a store job may wait for each free staging slab before it is reported failed (a job
    #: that keeps making progress is never cut short). Jobs share the slabs with the other job
    #: threads' jobs, so a tier writing at its full speed still makes a job wait several slab
    #: writes: with S3 alone at 0.12 GB/s and 2 s, 9-18% of the chunks of eight 64 MiB jobs
    #: offered at once were dropped (`dtkv bench tiering`); a tier stalled this long is failing.
    store_wait_s: float = 10.0
    #: emit KV events for this tier (effective only when vLLM's KV cache events are on)
    enable_kv_events: bool = True
    #: keys most recently stored whose residency can be announced (LRU)
    tracked_keys: int = 1 << 18
    #: "LOCAL" or "REMOTE": overrides the derived locality (SSD: LOCAL, S3 alone: REMOTE), e.g. for an
    #: ssd_dir on shared storage; vLLM also reads it for its back-pressure defaults
    locality: str | None = None

    def __post_init__(self) -> None:
        if self.job_threads < 1:
            raise ConfigError("job_threads: must be at least 1")
        if self.store_wait_s < 0:
            raise ConfigError("store_wait_s: must be >= 0")
        if self.tracked_keys < 1:
            raise ConfigError("tracked_keys: must be at least 1")
        if self.locality is not None and self.locality.upper() not in ("LOCAL", "REMOTE"):
            raise ConfigError(f"locality: must be LOCAL or REMOTE, got {self.locality!r}")


_OPTION_NAMES = frozenset(f.name for f in fields(TierOptions))
#: settings whose adapter default differs from TieredKVConfig's
ADAPTER_DEFAULTS: Mapping[str, Any] = {"host_capacity_bytes": 0}


def split_settings(settings: Mapping[str, Any]) -> tuple[TieredKVConfig, TierOptions]:
    """The store's validated settings and the tier's options from one ``secondary_tiers`` entry."""
    own = {k: v for k, v in settings.items() if k in _OPTION_NAMES}
    defaults = {k: v for k, v in ADAPTER_DEFAULTS.items() if ENV_PREFIX + k.upper() not in os.environ}
    store = {**defaults, **{k: v for k, v in settings.items() if k not in _OPTION_NAMES}}
    config = TieredKVConfig.from_mapping(store)
    if config.ssd_dir is None and config.object_url is None:
        raise ConfigError("the vLLM secondary tier needs ssd_dir, object_url or both")
    return config, TierOptions(**own)
