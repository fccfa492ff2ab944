"""dynamo-tiered-kv: persistent, tiered KV-cache storage for NVIDIA Dynamo and vLLM."""

__version__ = "0.1.0"
