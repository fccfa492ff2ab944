"""sessions: agent sessions replayed against the real store: recency vs retention hints vs hints + prefetch.

``replay`` runs each policy over the trace against a fresh store and builds the result, ``trace``
makes the sessions (who sends which turn when, on a simulated clock).
"""

from .replay import add_arguments, format_result, run

__all__ = ["add_arguments", "format_result", "run"]
