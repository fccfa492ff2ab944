"""The fault-injecting TCP proxy the S3 tests put in front of a server: it lives with the
benchmarks (``dynamo_tiered_kv.bench._faultproxy``, which ``dtkv bench faults`` drives) and is
re-exported here for the tests."""

from dynamo_tiered_kv.bench._faultproxy import MODES, FaultProxy

__all__ = ["MODES", "FaultProxy"]
