"""``dtkv plan``: how many minutes of context each tier holds, what each tier costs a month,
modeled TTFT of restoring a prefix vs recomputing it, and the HDD spindles a restore target needs
(docs/PLAN.md has the formulas)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ._deferred import defer

if TYPE_CHECKING:
    from ..plan.model import Scenario
    from ..plan.models import ModelSpec
    from ..plan.spindles import SpindleModel

_TIER_OF = {"hbm": "HBM", "dram": "DRAM", "ssd": "SSD", "hdd": "HDD-S3", "s3": "HDD-S3"}


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type accepting only numbers > 0 of ``kind``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v.replace("_", "")) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return values


def _price(text: str) -> tuple[str, float]:
    tier, _, usd = text.partition("=")
    if tier.lower() not in _TIER_OF:
        raise argparse.ArgumentTypeError(f"--price: tier must be one of {', '.join(_TIER_OF)}, got {tier!r}")
    try:
        value = float(usd)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--price: expected TIER=USD_PER_GB_MONTH, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--price: must be >= 0, got {text!r}")
    return tier.lower(), value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity (minutes of context), cost per month and restore-vs-recompute TTFT per tier",
        description=__doc__,
    )
    defer(p, _add_arguments)  # the model presets import the codec (torch): only for `dtkv plan`


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from ..plan.hardware import GPUS
    from ..plan.models import DTYPES, PRESETS
    from ..plan.scenarios import SCENARIOS

    pos, pint = _positive(float), _positive(int)
    g = p.add_argument_group("scenario")
    g.add_argument("--preset", choices=sorted(SCENARIOS), help="start from a named scenario (seed: the seed study)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    g = p.add_argument_group("model (a preset, or a custom shape)")
    g.add_argument("--model", help=f"preset: {', '.join(m.name for m in PRESETS.values())}")
    g.add_argument("--layers", type=pint, help="custom model: layers")
    g.add_argument("--kv-heads", type=pint, help="custom model: KV heads (1 with --mla)")
    g.add_argument("--head-size", type=pint, help="custom model: head size (MLA: latent dim)")
    g.add_argument("--q-heads", type=pint, help="custom model: query heads (default: --kv-heads)")
    g.add_argument("--params-b", type=pos, help="custom model: active parameters, billions (default: 12*L*d^2)")
    g.add_argument("--mla", action="store_true", help="custom model uses multi-head latent attention")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="KV cache dtype (default bf16)")
    g.add_argument("--block-size", type=pint, help="tokens per KV block (default 16)")
    g.add_argument("--mla-one-copy", action="store_true", help="MLA: TP ranks store one shared copy, not one each")
    g = p.add_argument_group("load and GPU")
    g.add_argument("--tokens-per-s", type=pos, help="new KV tokens per second the tiers absorb (default 8192)")
    g.add_argument("--gpu", help=f"GPU of the capacity table: {', '.join(x.name for x in GPUS.values())}")
    g.add_argument("--gpus", help="comma-separated GPUs for the TTFT table (default: all presets)")
    g.add_argument("--tp", type=pint, help="tensor-parallel GPUs per instance (default: smallest that fits)")
    g.add_argument("--gpu-mem-gb", type=pos, help="override GPU memory (GiB, as vendors size memory)")
    g.add_argument("--gpu-tflops", type=pos, help="override dense bf16 TFLOP/s")
    g.add_argument("--host-link-gbps", type=pos, help="override host-to-GPU copy GB/s")
    g.add_argument("--gpu-usd-per-hour", type=pos, help="override GPU rent, the basis of HBM's price")
    g.add_argument("--gpu-util", type=pos, help="share of HBM the engine uses (default 0.9)")
    g.add_argument("--mfu", type=pos, help="prefill model FLOP utilization (default 0.5)")
    g.add_argument("--no-weights", action="store_true", help="do not subtract weights from HBM (as the seed)")
    g.add_argument("--context-tokens", type=_int_list, help="prompt lengths for TTFT (default 8192,32768,131072)")
    g = p.add_argument_group("tiers (capacity, bandwidth, price)")
    g.add_argument("--dram-gb", type=pos, help="DRAM (GiB; 1024 = 1 TiB, the default)")
    g.add_argument("--dram-reserve-gb", type=float, help="DRAM kept for OS/engine/staging, GiB (default 64)")
    g.add_argument("--dram-gbps", type=pos, help="DRAM read GB/s before the host-link cap (default 200)")
    g.add_argument("--ssd-tb", type=pos, help="NVMe SSD, decimal TB (default 30.72)")
    g.add_argument("--ssd-gbps", type=pos, help="SSD read GB/s (default 14)")
    g.add_argument("--hdd-tb", type=pos, help="HDD-backed S3, decimal TB (default 500)")
    g.add_argument("--hdd-gbps", type=pos, help="HDD-S3 read GB/s for one restore (default 5)")
    g.add_argument("--hdd-latency-ms", type=pos, help="HDD-S3 time to first byte, ms (default 30)")
    g.add_argument("--price", type=_price, action="append", metavar="TIER=USD", help="$/GB-month, repeatable")
    _add_spindle_arguments(p)
    p.set_defaults(func=run)


def _nonnegative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _add_spindle_arguments(p: argparse.ArgumentParser) -> None:
    pos, pint = _positive(float), _positive(int)
    g = p.add_argument_group("HDD spindles (a restore from an HDD pool within a target time)")
    g.add_argument("--restore-target-ms", type=pos, help="restore time to meet (default: the recompute time of "
                                                         "the restored tokens on --gpu)")
    g.add_argument("--restore-sessions", type=pint, help="restores at once on the pool (default 1)")
    g.add_argument("--gets-in-flight", type=pint, help="ranged GETs in flight per restore (default 8, "
                                                       "s3_read_concurrency)")
    g.add_argument("--hdd-seek-ms", type=_nonnegative, help="wait per disk operation, ms (default 8)")
    g.add_argument("--hdd-spindle-mbps", type=pos, help="streaming read per spindle, MB/s (default 200)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--get-mib", type=pos, help="ranged GET size, MiB (default 16)")
    shape.add_argument("--requests-per-gb", type=pos, help="requests per restored GB, as `dtkv bench` reports "
                                                           "them (sets the GET size to 1e9 / this)")
    g.add_argument("--hdd-stripe-mib", type=_nonnegative, help="gateway stripe: one disk op per stripe a GET "
                                                               "touches, MiB (default 4, Ceph RGW; 0: one op)")
    g.add_argument("--hdd-data-shards", type=pint, help="disks one stripe is read from: k of an erasure code "
                                                        "k+m (default 8, as the price table's 8+3; 1: replicated)")


def _spindles(args: argparse.Namespace, base: SpindleModel) -> SpindleModel:
    from ..plan.spindles import MIB

    get_bytes = base.get_bytes
    if args.get_mib:
        get_bytes = args.get_mib * MIB
    elif args.requests_per_gb:
        get_bytes = 1e9 / args.requests_per_gb

    def pick(value: float | None, scale: float, default: float) -> float:
        return value * scale if value is not None else default

    return replace(
        base,
        seek_s=pick(args.hdd_seek_ms, 1e-3, base.seek_s),
        spindle_gbps=pick(args.hdd_spindle_mbps, 1e-3, base.spindle_gbps),
        get_bytes=get_bytes,
        stripe_bytes=pick(args.hdd_stripe_mib, MIB, base.stripe_bytes),
        data_shards=args.hdd_data_shards or base.data_shards,
        gets_in_flight=args.gets_in_flight or base.gets_in_flight,
        sessions=args.restore_sessions or base.sessions,
        target_s=args.restore_target_ms / 1e3 if args.restore_target_ms else base.target_s,
    )


def _model(args: argparse.Namespace, base: ModelSpec) -> tuple[ModelSpec, list[str]]:
    from ..plan.models import ModelSpec, preset

    custom = [args.layers, args.kv_heads, args.head_size]
    notes: list[str] = []
    if args.model and any(v is not None for v in custom):
        raise ConfigError("give either --model or --layers/--kv-heads/--head-size, not both")
    if any(v is not None for v in custom):
        if any(v is None for v in custom):
            raise ConfigError("a custom model needs all of --layers, --kv-heads and --head-size")
        q = args.q_heads or args.kv_heads
        if args.params_b:
            params = args.params_b * 1e9
        else:
            params = 12.0 * args.layers * (q * args.head_size) ** 2
            notes.append(f"custom model: active params estimated as 12 x layers x d_model^2 = {params:.3g}")
        model = ModelSpec("custom", args.layers, args.kv_heads, args.head_size, q, params, mla=args.mla)
    else:
        model = preset(args.model) if args.model else base
    if args.dtype:
        model = model.with_dtype(args.dtype)
    return model, notes


def _override_tiers(s: Scenario, args: argparse.Namespace, prices: dict[str, float]) -> tuple:
    from ..plan.hardware import GIB, TB

    tiers = []
    for t in s.tiers:
        if t.name == "DRAM":
            t = replace(
                t,
                capacity_bytes=args.dram_gb * GIB if args.dram_gb else t.capacity_bytes,
                reserve_bytes=args.dram_reserve_gb * GIB if args.dram_reserve_gb is not None else t.reserve_bytes,
                read_gbps=args.dram_gbps or t.read_gbps,
            )
        elif t.name == "SSD":
            t = replace(t, capacity_bytes=args.ssd_tb * TB if args.ssd_tb else t.capacity_bytes)
            t = replace(t, read_gbps=args.ssd_gbps or t.read_gbps)
        elif t.name == "HDD-S3":
            t = replace(t, capacity_bytes=args.hdd_tb * TB if args.hdd_tb else t.capacity_bytes)
            t = replace(t, read_gbps=args.hdd_gbps or t.read_gbps)
            if args.hdd_latency_ms:
                t = replace(t, latency_s=args.hdd_latency_ms / 1e3)
        if t.name in prices:
            t = replace(t, price_gb_month=prices[t.name])
        tiers.append(t)
    return tuple(tiers)


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The Scenario the flags describe: the preset (or the default), then each flag given."""
    from ..plan import scenario
    from ..plan.hardware import GB, HOURS_PER_MONTH, gpu

    s = scenario(args.preset or "default")
    overridden = [
        f"--{k.replace('_', '-')}"
        for k, v in vars(args).items()
        if k not in ("preset", "json", "func", "command", "verbose", "gpus", "context_tokens")
        and v not in (None, False)
    ]
    model, notes = _model(args, s.model)
    prices = {_TIER_OF[k]: v for k, v in (args.price or [])}
    the_gpu = gpu(args.gpu) if args.gpu else s.gpu
    the_gpu = replace(
        the_gpu,
        mem_gib=args.gpu_mem_gb or the_gpu.mem_gib,
        bf16_tflops=args.gpu_tflops or the_gpu.bf16_tflops,
        host_link_gbps=args.host_link_gbps or the_gpu.host_link_gbps,
        usd_per_hour=args.gpu_usd_per_hour or the_gpu.usd_per_hour,
    )
    if "HBM" in prices:
        the_gpu = replace(the_gpu, usd_per_hour=prices["HBM"] * the_gpu.mem_bytes / GB / HOURS_PER_MONTH)
    ttft_gpus = s.ttft_gpus
    if args.gpus:
        ttft_gpus = tuple(gpu(n.strip()) for n in args.gpus.split(",") if n.strip())
    # the capacity GPU (with its overrides) replaces its preset in the TTFT comparison
    ttft_gpus = tuple(the_gpu if x.name == the_gpu.name else x for x in ttft_gpus)
    tp = args.tp or (s.tp if model == s.model and the_gpu.mem_gib == s.gpu.mem_gib else None)
    extra = list(notes)
    if args.preset and overridden:
        extra.append(f"{args.preset} preset changed on the command line by {', '.join(overridden)}")
    return replace(
        s,
        model=model,
        gpu=the_gpu,
        tokens_per_s=args.tokens_per_s or s.tokens_per_s,
        tiers=_override_tiers(s, args, prices),
        tp=tp,
        block_size=args.block_size or s.block_size,
        mfu=args.mfu or s.mfu,
        gpu_util=args.gpu_util or s.gpu_util,
        count_weights=s.count_weights and not args.no_weights,
        mla_one_copy=s.mla_one_copy or args.mla_one_copy,
        contexts=args.context_tokens or s.contexts,
        ttft_gpus=ttft_gpus,
        assumptions=(*s.assumptions, *extra),
        spindles=_spindles(args, s.spindles),
    )


def run(args: argparse.Namespace) -> int:
    from ..plan import format_text, plan, to_dict

    try:
        result = plan(build_scenario(args))
    except ConfigError as exc:
        print(f"dtkv plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_dict(result), indent=2) if args.json else format_text(result))
    return 0
