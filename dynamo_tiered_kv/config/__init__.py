"""Settings: the typed ``TieredKVConfig`` and its sources (``settings``), byte sizes as people write
them (``sizes``), and the ``dtkv`` commands' view of the same settings (``settings_cli``).
"""

from .settings import TieredKVConfig

__all__ = ["TieredKVConfig"]
