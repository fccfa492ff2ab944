"""agentic: multi-turn agents on the vLLM CPU engine: TTFT recompute vs restore from host, SSD, objects.

``conversations`` runs the engine sessions (``bench.engine``) and builds the result, ``report``
its tables, summary and plots.
"""

from .conversations import add_arguments, format_result, run

__all__ = ["add_arguments", "format_result", "run"]
