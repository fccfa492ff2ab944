"""What the probe's sections share: the command line (``WORK_DIR``, ``--cpu``), the device, the
shapes, a stand-in forward pass, engine layouts and the section runner."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CPU = "--cpu" in sys.argv
W = Path(next((a for a in sys.argv[1:] if not a.startswith("--")), ".gpu-site/probe")).resolve()
DEV = torch.device("cpu") if CPU else torch.device("cuda", 0)

from dynamo_tiered_kv.blocks.codec import header_bytes, record_bytes  # noqa: E402
from dynamo_tiered_kv.blocks.keys import Namespace  # noqa: E402
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv  # noqa: E402
from dynamo_tiered_kv.staging.device_copy import engine_mark  # noqa: E402
from dynamo_tiered_kv.staging.device_order import cuda_ops, inline_ops  # noqa: E402

FA = EngineLayoutKind.FLASH_ATTN
OPS = inline_ops() if CPU else cuda_ops()
SLAB = (1 << 20) if CPU else (32 << 20)  # one staging slab (the default staging_slab_bytes on a GPU)
CHUNK = (256 << 10) if CPU else (8 << 20)  # the store's restore chunk
# (layers, heads, head size, blocks, records): real shapes on a GPU, small ones for the dry run
SAVE = (4, 2, 64, 96, 0) if CPU else (32, 8, 128, 512, 0)  # Llama-3.1-8B-like: 64 KiB per layer and block
RATE = (4, 2, 64, 40, 32) if CPU else (32, 8, 128, 300, 256)
BUSY = (8, 1, 128, 64, 48) if CPU else (80, 1, 128, 1040, 1024)  # 70B at TP8: 8 KiB per layer and block
STEP_MS = 20.0  # a stand-in forward step on a busy server
#: the sections that raised, by name
failed: list[str] = []


def section(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            failed.append(fn.__name__)
            print(f"[{fn.__name__}] EXCEPTION\n{traceback.format_exc()}")
        print(f"[{fn.__name__}] section took {time.perf_counter() - t0:.1f}s", flush=True)

    return run


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def ms(t: float) -> str:
    return f"{1e3 * t:.2f} ms"


_CYCLES_PER_MS: float | None = None


def forward_ms(ms_: float) -> None:
    """A stand-in forward pass: one kernel that keeps the engine's (current) stream busy for ``ms_``."""
    global _CYCLES_PER_MS
    if CPU:
        return
    if _CYCLES_PER_MS is None:
        torch.cuda._sleep(200_000_000)  # clocks up
        sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(100_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS = 100_000_000 / a.elapsed_time(b)
        print(f"[calib] torch.cuda._sleep: {_CYCLES_PER_MS / 1e6:.2f} Mcycles/ms")
    torch.cuda._sleep(int(ms_ * _CYCLES_PER_MS))


def engine_point() -> Any:
    """An event after everything queued so far on the engine's (current) stream."""
    ev = OPS.event()
    ev.record(OPS.current_stream(DEV))
    return ev


def load_mark() -> Any:
    """What the vLLM connector records in ``start_load_kv``: the engine's point for one load (None on CPU)."""
    return None if CPU else engine_mark(DEV)


def engine(geom: tuple[int, int, int, int, int], seed: int = 0) -> EngineLayout:
    layers, heads, dim, blocks, _ = geom
    ts = allocate_engine_kv(FA, num_layers=layers, num_blocks=blocks, block_size=16, num_kv_heads=heads,
                            head_size=dim, dtype=torch.bfloat16, device=str(DEV))
    g = torch.Generator(device=str(DEV)).manual_seed(seed)
    for t in ts:
        t.normal_(generator=g)
    return EngineLayout(FA, ts, 16, heads, dim)


def on_cpu(lay: EngineLayout) -> EngineLayout:
    s = lay.shape
    return EngineLayout(FA, [t.cpu() for t in lay.tensors], 16, s.num_kv_heads, s.head_size)


def ns_of(lay: EngineLayout) -> Namespace:
    s = lay.shape
    return Namespace("probe", "bf16", "FLASH_ATTN", s.block_size, s.num_layers, s.num_kv_heads, s.head_size)


def geometry(lay: EngineLayout) -> tuple[int, int, int]:
    s = lay.shape
    return record_bytes(s), header_bytes(s.num_layers), s.layer_bytes


def views(lay: EngineLayout) -> list[torch.Tensor]:
    return [v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for v in lay.layer_views]

