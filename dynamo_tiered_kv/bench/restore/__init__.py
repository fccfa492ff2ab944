"""restore: marginal restore time of a long prefix per tier on the vLLM CPU engine vs the raw read of its bytes.

``marginal`` plans the engine sessions and builds the result, ``engine`` is one session in its own
process (``python -m dynamo_tiered_kv.bench.restore.engine``), ``raw`` the raw reads of the same
bytes, ``report`` the summary and tables. ``reads`` stands alone: one SSD restore read through
NIXL against ``preadv`` (``python -m dynamo_tiered_kv.bench.restore.reads DIR``).
"""

from .marginal import add_arguments, format_result, run

__all__ = ["add_arguments", "format_result", "run"]
