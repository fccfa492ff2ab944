"""interference: inter-token latency of decoding requests while other requests restore long prefixes.

``decode_latency`` plans the engine sessions and builds the result (the model and tiers are
``restore``'s, built by ``engine.launch``), ``engine`` is one session in its own process (``python -m
dynamo_tiered_kv.bench.interference.engine``), ``step_trace`` the per-step wall and thread CPU
times it records.
"""

from .decode_latency import add_arguments, format_result, run

__all__ = ["add_arguments", "format_result", "run"]
