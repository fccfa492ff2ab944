"""vLLM's CPU tier (the primary) as an ``EngineLayout`` our store can gather from and scatter into.

The primary memoryview is ``(num_chunks, row_bytes)`` bytes over vLLM's shared offload region;
``view[c]`` is chunk ``c``: every worker's pages of ``blocks_per_chunk`` GPU blocks, in vLLM's
host layout, padding included. Its bytes are opaque to us, so it is bound as a ``VLLM_CPU`` layout
(the canonical format that stores an engine's own block bytes as-is) with one layer of one
token: ``head_size = row_bytes / 2``. What the bytes mean is pinned by the namespace
(``key_mapping``), which names the geometry vLLM laid them out with.
"""

from __future__ import annotations

import numpy as np
import torch

from ...blocks.layout import EngineLayout, EngineLayoutKind
from ...errors import ConfigError


def primary_rows(view: memoryview) -> np.ndarray:
    """The primary as ``(num_chunks, row_bytes)`` uint8 rows over vLLM's region (no copy): row ``c``
    is exactly the payload of chunk ``c``'s record in the ``primary_layout`` shape, so a record's
    payload may be read straight into it (``TieredStore.load_into``)."""
    arr = np.asarray(view).view(np.uint8)
    if arr.ndim != 2 or not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ConfigError(f"primary KV view must be writable contiguous (num_chunks, row_bytes) bytes, got {arr.shape}")
    return arr


def primary_layout(view: memoryview) -> EngineLayout:
    """Zero-copy layout over the primary memoryview (writable: loads scatter into it)."""
    arr = np.asarray(view)
    if arr.ndim != 2 or arr.itemsize != 1 or not arr.flags.c_contiguous:
        raise ConfigError(f"primary KV view must be contiguous (num_chunks, row_bytes) bytes, got {arr.shape} "
                          f"of {arr.dtype}")
    n, row = arr.shape
    if row % 2:
        raise ConfigError(f"primary KV rows must have an even byte count, got {row}")
    rows = torch.from_numpy(arr.view(np.uint8)).reshape(n, 1, 1, row)
    return EngineLayout(EngineLayoutKind.VLLM_CPU, [rows], block_size=1, num_kv_heads=1, head_size=row // 2)
