"""Benchmarks run by ``dtkv bench <name>``; see ``commands/bench.py`` for the module convention."""
