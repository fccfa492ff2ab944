"""tiering: our vLLM secondary tier next to vLLM 0.33's own ``fs`` and ``obj`` tiers, under the same manager.

``side_by_side`` drives the runs and the report, ``phases`` is one phase (store, load, lookup) in
its own process under vLLM's ``TieringOffloadingManager``, ``raw_s3`` the S3 server's own ceiling
(plain parallel ranged GETs of the same bytes) measured in the same run.
"""

from .side_by_side import add_arguments, format_result, run, targets

__all__ = ["add_arguments", "format_result", "run", "targets"]
