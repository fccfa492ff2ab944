"""``TieredStore``: the facade over the tiers (``store``) and the parts it builds: its writer
(``writes``, ``deferred_encode``), its reader (``reads``), its retention service (``retention``),
the state they share (``state``), its shutdown (``lifecycle``) and its metrics (``metrics``).
"""

from .store import TieredStore

__all__ = ["TieredStore"]
