"""Engine adapters (``vllm``)."""
