"""The vLLM CPU engine sessions that ``restore``, ``interference``, ``tiers`` and ``agentic`` run.

Not a bench itself (no ``run``). ``launch`` is the parent side: the benchmark model, engine
sessions in fresh processes one after another under one progress bar (``EngineSessions``,
``run_plan``), and what their specs share (model, object tier, connector settings). ``session`` is
the child side: ``Session`` (an in-process ``LLM`` plus the probes read around each request),
``start``/``progress``/``finish`` that every session module uses, and the ``agentic`` / ``tiers``
session itself (``python -m dynamo_tiered_kv.bench.engine.session SPEC.json OUT.json``).
"""
