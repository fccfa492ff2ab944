"""The engine-shaped KV the store-level benchmarks restore into (no engine): model shapes by name
and a FlashAttention-layout allocation of them."""

from __future__ import annotations

import torch

from ..blocks.keys import Namespace
from ..blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv

#: name -> (layers, KV heads, head size), bf16
SHAPES = {"qwen2-7b-ish": (8, 2, 128), "qwen2.5-0.5b": (24, 2, 64), "llama-3.1-8b": (32, 8, 128)}
BLOCK_TOKENS = 16


def flash_layout(shape: str, blocks: int, *, name: str, fill: bool = True) -> tuple[EngineLayout, Namespace]:
    """``blocks`` + 1 blocks of ``shape`` (block 0 stays unused, as an engine's null block), random
    normal values when ``fill``, and the namespace ``name`` stores them under."""
    layers, heads, hs = SHAPES[shape]
    kind = EngineLayoutKind.FLASH_ATTN
    ts = allocate_engine_kv(kind, num_layers=layers, num_blocks=blocks + 1, block_size=BLOCK_TOKENS,
                            num_kv_heads=heads, head_size=hs, dtype=torch.bfloat16)
    if fill:
        for t in ts:
            t.normal_()
    ns = Namespace(name, "bfloat16", kind.name, BLOCK_TOKENS, layers, heads, hs)
    return EngineLayout(kind, ts, BLOCK_TOKENS, heads, hs), ns
