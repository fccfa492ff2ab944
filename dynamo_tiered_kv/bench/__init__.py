"""Benchmarks run by ``dtkv bench <name>``; see ``commands/bench.py`` for the module convention.

The tree lists the benchmarks: a bench of one module is ``<name>.py``; a bench of several is a
package ``<name>/`` whose ``__init__`` exposes ``add_arguments`` / ``run`` / ``format_result`` and
names its parts (the engine process, raw ceilings, report). What more than one bench uses sits
apart: ``engine/`` (the vLLM CPU engine sessions of ``restore``, ``interference``, ``tiers`` and
``agentic``), ``report.py`` (tables, progress) and ``_keys.py`` (block keys of ``ssd``, ``s3``,
``sglang`` and the test records). ``interference`` is its own package, not part of ``restore``:
it is its own command, and it uses ``restore``'s model, tiers and engine from there.
"""
