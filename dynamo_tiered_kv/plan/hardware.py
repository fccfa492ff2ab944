"""GPU and storage-tier presets for the planner, with the price table. Every value is an
assumption that the command line can override; docs/PLAN.md says where each comes from.

Units: memory (HBM, DRAM) is sized the way vendors sell it, in binary units, so "80 GB" of HBM
and "1 TB" of DIMMs are 80 GiB and 1 TiB. Drives (SSD, HDD) are sold in decimal units, so
"30.72 TB" is 30.72e12 bytes. Bandwidths are decimal GB/s (1e9 B/s); prices are $ per decimal GB
per month (730 hours).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

GIB = 2**30
TIB = 2**40
GB = 1e9
TB = 1e12
HOURS_PER_MONTH = 730.0

#: the engine's usable share of GPU memory (vLLM's gpu_memory_utilization default)
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model.

    Attributes:
        name: display name.
        mem_gib: memory as sold ("80 GB" HBM is 80 GiB).
        bf16_tflops: dense (no sparsity) BF16 tensor TFLOP/s from the vendor datasheet.
        hbm_gbps: memory bandwidth, GB/s.
        host_link_gbps: achievable host-to-device copy bandwidth, GB/s (every tier below HBM
            restores through it: PCIe Gen5 x16 about 55 of 64 theoretical, Gen4 about 26 of 32).
        usd_per_hour: assumed rental price, the basis of HBM's $/GB-month.
    """

    name: str
    mem_gib: float
    bf16_tflops: float
    hbm_gbps: float
    host_link_gbps: float
    usd_per_hour: float

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * GIB

    @property
    def hbm_price_gb_month(self) -> float:
        """The GPU's monthly rent spread over its memory: what a GB of HBM costs a month."""
        return self.usd_per_hour * HOURS_PER_MONTH / (self.mem_bytes / GB)


GPUS: dict[str, GpuSpec] = {
    g.name.lower(): g
    for g in (
        GpuSpec("H100", 80, 989, 3350, 55, 2.50),
        GpuSpec("H200", 141, 989, 4800, 55, 3.50),
        GpuSpec("B200", 180, 2250, 8000, 55, 5.00),
        GpuSpec("L40S", 48, 362, 864, 26, 1.00),
        GpuSpec("A100", 80, 312, 2039, 26, 1.50),
    )
}


def gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(f"--gpu: unknown {name!r}; presets: {', '.join(g.name for g in GPUS.values())}") from None


@dataclass(frozen=True)
class Price:
    """$/GB-month from an amortized purchase: capex * overhead / lifetime.

    Attributes:
        capex_usd_per_gb: purchase price per decimal GB of raw media.
        lifetime_months: amortization period.
        overhead: raw bytes bought per logical byte stored (replication or erasure coding).
        basis: where the figure comes from, printed with the plan.
    """

    capex_usd_per_gb: float
    lifetime_months: float
    overhead: float
    basis: str

    @property
    def usd_per_gb_month(self) -> float:
        return self.capex_usd_per_gb * self.overhead / self.lifetime_months


#: The default price table (hardware only: no servers, power, network or staff).
PRICES: dict[str, Price] = {
    "dram": Price(4.00, 36, 1.0, "DDR5 RDIMM at $4/GB over 3 years"),
    "ssd": Price(0.12, 60, 1.0, "Gen5 TLC NVMe at $120/TB over 5 years"),
    "hdd": Price(0.016, 60, 1.375, "HDD at $16/TB over 5 years, erasure coding 8+3 (x1.375)"),
}


@dataclass(frozen=True)
class TierSpec:
    """One storage tier as the planner sees it.

    Attributes:
        name: HBM, DRAM, SSD or HDD-S3.
        capacity_bytes: raw capacity provisioned (what is paid for).
        read_gbps: the tier's read bandwidth for one restore stream, GB/s.
        latency_s: fixed latency before the first byte of a restore (request, seek, RTT).
        price_gb_month: $ per decimal GB of capacity per month.
        usable_fraction: share of the capacity that can hold KV.
        reserve_bytes: bytes taken off the usable share (weights, OS, engine, staging).
        over_host_link: restores cross the GPU's host link (all tiers below HBM).
        holds_records: the tier holds our codec records (headers counted) rather than the
            engine's raw paged KV.
        note: the assumption behind the numbers, printed with the plan.
    """

    name: str
    capacity_bytes: float
    read_gbps: float
    latency_s: float
    price_gb_month: float
    usable_fraction: float = 1.0
    reserve_bytes: float = 0.0
    over_host_link: bool = True
    holds_records: bool = True
    note: str = ""

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError(f"{self.name}: capacity must be >= 0")
        if self.read_gbps <= 0:
            raise ConfigError(f"{self.name}: read bandwidth must be > 0 GB/s")
        if self.latency_s < 0 or self.price_gb_month < 0 or self.reserve_bytes < 0:
            raise ConfigError(f"{self.name}: latency, price and reserve must be >= 0")
        if not 0 < self.usable_fraction <= 1:
            raise ConfigError(f"{self.name}: usable fraction must be in (0, 1]")

    @property
    def usable_bytes(self) -> float:
        return max(0.0, self.capacity_bytes * self.usable_fraction - self.reserve_bytes)


def dram_tier(capacity_gib: float = 1024, *, reserve_gib: float = 64, read_gbps: float = 200) -> TierSpec:
    return TierSpec(
        "DRAM",
        capacity_gib * GIB,
        read_gbps,
        10e-6,
        PRICES["dram"].usd_per_gb_month,
        reserve_bytes=reserve_gib * GIB,
        note=f"{reserve_gib:g} GiB kept for OS, engine and staging; pinned host copies",
    )


def ssd_tier(capacity_tb: float = 30.72, *, read_gbps: float = 14.0, usable_fraction: float = 0.9) -> TierSpec:
    return TierSpec(
        "SSD",
        capacity_tb * TB,
        read_gbps,
        100e-6,
        PRICES["ssd"].usd_per_gb_month,
        usable_fraction=usable_fraction,
        note="one Gen5 NVMe (14 GB/s sequential read, D7-PS1010 class); 10% free for segment turnover",
    )


def hdd_tier(capacity_tb: float = 500, *, read_gbps: float = 5.0) -> TierSpec:
    return TierSpec(
        "HDD-S3",
        capacity_tb * TB,
        read_gbps,
        30e-3,
        PRICES["hdd"].usd_per_gb_month,
        note="S3 on an HDD pool: ~20 drives x 250 MB/s streaming a prefix run; 30 ms to first byte",
    )
