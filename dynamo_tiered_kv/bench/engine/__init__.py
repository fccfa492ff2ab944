"""The vLLM CPU engine sessions that ``restore``, ``interference``, ``tiers`` and ``agentic`` run.

Not a bench itself (no ``run``). ``launch`` is the parent side: the benchmark model, one engine
session in a fresh process, its progress bar. ``session`` is the child side: ``Session`` (an
in-process ``LLM`` plus the probes read around each request), and the ``agentic`` / ``tiers``
session itself (``python -m dynamo_tiered_kv.bench.engine.session SPEC.json OUT.json``).
"""
