"""Test support shipped with the package: record factories and the tier conformance suite.

Third-party tiers subclass ``TierConformanceTests`` exactly as the built-in ones do.
"""

from .conformance import TierConformanceTests
from .records import make_record, random_key, small_shape

__all__ = ["TierConformanceTests", "make_record", "random_key", "small_shape"]
