"""``TieredStore``: the facade over the tiers (``store``), its offload path (``writes``,
``deferred_encode``), its restore pipeline (``reads``), its retention API (``retention``), its
shutdown (``lifecycle``) and its metrics (``metrics``).
"""

from .store import TieredStore

__all__ = ["TieredStore"]
