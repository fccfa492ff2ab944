"""Batched gather/scatter between an engine's paged KV layout and canonical block records.

``gather_records`` / ``scatter_records`` move the payloads of *n* blocks for *all* layers with a
constant number of launches (one Triton kernel on CUDA when Triton is available, otherwise one
``index_select`` + one strided copy per layer), instead of one copy per block per layer. The
record headers and checksums are the codec's job; these functions only move payload bytes.
"""

from .gather_scatter import gather_records, scatter_records, triton_available
from .xxh3 import to_unsigned, xxh3_64_rows

__all__ = ["gather_records", "scatter_records", "to_unsigned", "triton_available", "xxh3_64_rows"]
