"""The planner's arithmetic: minutes of context per tier, cost per tier, and modeled time to first
token (TTFT) of restoring a prefix versus recomputing it. Formulas (docs/PLAN.md explains them):

    minutes(tier)   = usable_bytes / (tokens_per_s * bytes_per_token) / 60
    usd_month(tier) = capacity_GB * price_per_GB_month
    prefill_flops(T) = 2 * P_active * T + layers * q_heads * (d_qk + d_v) * T * (T + 1)
    recompute(T)    = prefill_flops(T) / (tp * peak_bf16_flops * MFU)
    restore(T)      = latency + stored_bytes(R) / min(tier_bw, tp * host_link_bw)
                      + (prefill_flops(T) - prefill_flops(R)) / (tp * peak_bf16_flops * MFU)

The attention term counts Q.K^T (2 * d_qk FLOPs per query-key pair per head) and P.V
(2 * d_v) over the T(T+1)/2 causal pairs. R is the restored prefix: the whole blocks before the
last prompt token, which the engine always computes itself. HDD spindles per restore target:
``spindles.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError
from .hardware import GPU_MEMORY_UTILIZATION, GPUS, GpuSpec, TierSpec
from .models import ModelSpec
from .spindles import SpindleModel, SpindleRow, spindles_for

DEFAULT_CONTEXTS = (8192, 32768, 131072)
DEFAULT_MFU = 0.5
#: auto TP picks the smallest power of two that leaves this share of usable HBM for KV
MIN_KV_SHARE = 0.2


@dataclass(frozen=True)
class Scenario:
    """Everything one plan is computed from.

    Attributes:
        model: KV shape and parameter counts.
        gpu: the GPU the capacity table is for (HBM tier).
        tokens_per_s: new KV tokens per second that the tiers must hold (all TP ranks).
        tiers: the tiers below HBM, fastest first.
        tp: tensor-parallel GPUs per instance; None picks the smallest that fits (auto_tp).
        block_size: tokens per KV block (vLLM's default is 16).
        mfu: model FLOP utilization of prefill.
        gpu_util: share of HBM the engine may use (vLLM gpu_memory_utilization).
        count_weights: subtract the weights from usable HBM.
        mla_one_copy: stored tiers keep one copy of an MLA block instead of one per TP rank.
        contexts: prompt lengths for the TTFT table.
        ttft_gpus: GPUs the TTFT table compares.
        name: scenario name printed with the plan.
        assumptions: extra lines printed with the plan (a preset's stated assumptions).
        spindles: the HDD pool and restore workload of the spindle table (``spindles.py``).
    """

    model: ModelSpec
    gpu: GpuSpec
    tokens_per_s: float
    tiers: tuple[TierSpec, ...]
    tp: int | None = None
    block_size: int = 16
    mfu: float = DEFAULT_MFU
    gpu_util: float = GPU_MEMORY_UTILIZATION
    count_weights: bool = True
    mla_one_copy: bool = False
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    ttft_gpus: tuple[GpuSpec, ...] = tuple(GPUS.values())
    name: str = "custom"
    assumptions: tuple[str, ...] = ()
    spindles: SpindleModel = field(default_factory=SpindleModel)

    def __post_init__(self) -> None:
        if not self.tokens_per_s > 0:
            raise ConfigError(f"--tokens-per-s must be > 0, got {self.tokens_per_s}")
        if self.tp is not None and self.tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {self.tp}")
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, got {self.block_size}")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"--mfu must be in (0, 1], got {self.mfu}")
        if not 0 < self.gpu_util <= 1:
            raise ConfigError(f"--gpu-util must be in (0, 1], got {self.gpu_util}")
        if not self.contexts or any(t < 1 for t in self.contexts):
            raise ConfigError(f"--context-tokens must be positive integers, got {self.contexts}")


# ---------------------------------------------------------------- capacity and cost


def auto_tp(model: ModelSpec, gpu: GpuSpec, gpu_util: float = GPU_MEMORY_UTILIZATION) -> int:
    """Smallest power-of-two TP whose usable HBM holds the weights and leaves MIN_KV_SHARE for KV."""
    tp = 1
    while tp <= 1024:
        usable = tp * gpu.mem_bytes * gpu_util
        if usable - model.weight_bytes >= MIN_KV_SHARE * usable:
            return tp
        tp *= 2
    raise ConfigError(f"{model.name} does not fit on any TP size of {gpu.name}")


def hbm_tier(model: ModelSpec, gpu: GpuSpec, tp: int, gpu_util: float, count_weights: bool) -> TierSpec:
    """The GPU memory of an instance as a tier: usable = tp * mem * gpu_util - weights."""
    weights = model.weight_bytes if count_weights else 0.0
    return TierSpec(
        "HBM",
        tp * gpu.mem_bytes,
        tp * gpu.hbm_gbps,
        0.0,
        gpu.hbm_price_gb_month,
        usable_fraction=gpu_util,
        reserve_bytes=weights,
        over_host_link=False,
        holds_records=False,
        note=f"{tp} x {gpu.name} at gpu_memory_utilization {gpu_util:g}"
        + (f", minus {weights / 1e9:.1f} GB of weights" if count_weights else ", weights not counted"),
    )


def minutes_of_context(usable_bytes: float, tokens_per_s: float, bytes_per_token: float) -> float:
    """How many minutes of new tokens, at ``tokens_per_s``, fit in ``usable_bytes``."""
    return usable_bytes / (tokens_per_s * bytes_per_token) / 60.0


def usd_per_month(tier: TierSpec) -> float:
    return tier.capacity_bytes / 1e9 * tier.price_gb_month


# ---------------------------------------------------------------- time to first token


def prefill_flops(model: ModelSpec, tokens: int) -> float:
    """FLOPs to prefill ``tokens`` tokens from scratch (linear layers + causal attention)."""
    d_qk = model.qk_head_dim or model.head_size
    d_v = model.v_head_dim or model.head_size
    return 2.0 * model.active_params * tokens + model.layers * model.q_heads * (d_qk + d_v) * tokens * (tokens + 1)


def restorable_tokens(tokens: int, block_size: int) -> int:
    """Whole blocks before the last prompt token: what a restore can supply."""
    return (tokens - 1) // block_size * block_size


def flops_per_s(gpu: GpuSpec, tp: int, mfu: float) -> float:
    return tp * gpu.bf16_tflops * 1e12 * mfu


def restore_bandwidth(tier: TierSpec, gpu: GpuSpec, tp: int) -> float:
    """GB/s a restore from ``tier`` reaches: the tier, capped by the GPUs' host links."""
    return min(tier.read_gbps, tp * gpu.host_link_gbps) if tier.over_host_link else tier.read_gbps


def restore_seconds(nbytes: float, bandwidth_gbps: float, latency_s: float, compute_s: float) -> float:
    return latency_s + nbytes / (bandwidth_gbps * 1e9) + compute_s


def bandwidth_for_reduction(nbytes: float, recompute_s: float, compute_s: float, reduction: float) -> float:
    """GB/s a zero-latency tier needs for TTFT = (1 - reduction) * recompute; inf if unreachable."""
    budget = (1.0 - reduction) * recompute_s - compute_s
    return nbytes / budget / 1e9 if budget > 0 else math.inf


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class TierResult:
    name: str
    capacity_bytes: float
    usable_bytes: float
    bytes_per_token: float
    minutes: float
    minutes_raw: float
    price_gb_month: float
    usd_month: float
    restore_gbps: float
    latency_s: float
    note: str

    @property
    def hours(self) -> float:
        return self.minutes / 60.0

    @property
    def usd_month_per_context_hour(self) -> float:
        return self.usd_month / self.hours if self.hours > 0 else math.inf


@dataclass(frozen=True)
class TtftRow:
    gpu: str
    tp: int
    tokens: int
    restored_tokens: int
    recompute_s: float
    restore_s: dict[str, float]
    restore_bytes: dict[str, float]
    gbps_for_95: float

    def reduction(self, tier: str) -> float:
        """Fraction of recompute TTFT saved by restoring from ``tier`` (0.95 = 95% lower)."""
        return 1.0 - self.restore_s[tier] / self.recompute_s

    def speedup(self, tier: str) -> float:
        return self.recompute_s / self.restore_s[tier]


@dataclass(frozen=True)
class Plan:
    scenario: Scenario
    tp: int
    kv_bytes_per_token: int
    stored_bytes_per_token: float
    stored_bytes_per_block: int
    tiers: list[TierResult]
    ttft: list[TtftRow] = field(default_factory=list)
    spindles: list[SpindleRow] = field(default_factory=list)

    def tier(self, name: str) -> TierResult:
        return next(t for t in self.tiers if t.name.lower() == name.lower())


def _tier_result(tier: TierSpec, s: Scenario, tp: int, raw: int, stored: float) -> TierResult:
    # raw: the engine's KV bytes per token in the copies this tier keeps (all ranks in HBM)
    if tier.holds_records:
        raw = raw * s.model.stored_copies(tp, s.mla_one_copy) // tp
    per_token = stored if tier.holds_records else raw
    return TierResult(
        tier.name,
        tier.capacity_bytes,
        tier.usable_bytes,
        per_token,
        minutes_of_context(tier.usable_bytes, s.tokens_per_s, per_token),
        minutes_of_context(tier.usable_bytes, s.tokens_per_s, raw),
        tier.price_gb_month,
        usd_per_month(tier),
        restore_bandwidth(tier, s.gpu, tp),
        tier.latency_s,
        tier.note,
    )


def ttft_row(s: Scenario, gpu: GpuSpec, tokens: int, tp: int | None = None) -> TtftRow:
    """Recompute vs restore from every tier for one GPU and prompt length."""
    tp = tp or s.tp or auto_tp(s.model, gpu, s.gpu_util)
    rate = flops_per_s(gpu, tp, s.mfu)
    recompute = prefill_flops(s.model, tokens) / rate
    restored = restorable_tokens(tokens, s.block_size)
    suffix = (prefill_flops(s.model, tokens) - prefill_flops(s.model, restored)) / rate
    raw_bytes = restored * s.model.kv_bytes_per_token(tp)
    stored_bytes = restored // s.block_size * s.model.stored_bytes_per_block(s.block_size, tp, s.mla_one_copy)
    hbm = hbm_tier(s.model, gpu, tp, s.gpu_util, s.count_weights)
    times: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    for tier in (hbm, *s.tiers):
        b = stored_bytes if tier.holds_records else raw_bytes
        nbytes[tier.name] = b
        times[tier.name] = restore_seconds(b, restore_bandwidth(tier, gpu, tp), tier.latency_s, suffix)
    need = bandwidth_for_reduction(stored_bytes, recompute, suffix, 0.95)
    return TtftRow(gpu.name, tp, tokens, restored, recompute, times, nbytes, need)


def plan(s: Scenario) -> Plan:
    """Capacity, cost and TTFT tables for a scenario."""
    tp = s.tp or auto_tp(s.model, s.gpu, s.gpu_util)
    hbm = hbm_tier(s.model, s.gpu, tp, s.gpu_util, s.count_weights)
    if s.count_weights and hbm.usable_bytes <= 0:
        raise ConfigError(
            f"{s.model.name} weights ({s.model.weight_bytes / 1e9:.0f} GB) do not fit in {tp} x {s.gpu.name}; "
            "raise --tp or omit it"
        )
    raw = s.model.kv_bytes_per_token(tp)
    stored = s.model.stored_bytes_per_token(s.block_size, tp, s.mla_one_copy)
    tiers = [_tier_result(t, s, tp, raw, stored) for t in (hbm, *s.tiers)]
    rows = [ttft_row(s, g, n, s.tp) for g in s.ttft_gpus for n in s.contexts]
    block = s.model.stored_bytes_per_block(s.block_size, tp, s.mla_one_copy)
    return Plan(s, tp, raw, stored, block, tiers, rows, spindle_rows(s, tp, block))


def spindle_rows(s: Scenario, tp: int, stored_block_bytes: int) -> list[SpindleRow]:
    """Spindles per prompt length for a restore of its restorable prefix (stored records) within
    the target; without one, within recompute minus the suffix's compute on ``s.gpu``: a
    restore's TTFT then equals the recompute's."""
    rate = flops_per_s(s.gpu, tp, s.mfu)
    out = []
    for tokens in s.contexts:
        restored = restorable_tokens(tokens, s.block_size)
        if restored == 0:
            continue
        target = s.spindles.target_s
        if target is None:
            target = prefill_flops(s.model, restored) / rate  # = recompute(T) - suffix compute
        out.append(spindles_for(s.spindles, tokens, restored // s.block_size * stored_block_bytes, target))
    return out


__all__ = [
    "Plan",
    "Scenario",
    "TierResult",
    "TtftRow",
    "auto_tp",
    "bandwidth_for_reduction",
    "hbm_tier",
    "minutes_of_context",
    "plan",
    "prefill_flops",
    "restore_seconds",
    "spindle_rows",
    "ttft_row",
]
