"""Test support shipped with the package: record factories and the tier conformance suite.

Third-party tiers subclass ``TierConformanceTests`` exactly as the built-in ones do. It is a
pytest suite (it needs pytest and hypothesis, the ``test`` extra), so it is loaded on first use:
importing this package and its record helpers needs the runtime dependencies only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .records import make_record, random_key, small_shape

if TYPE_CHECKING:
    from .conformance import TierConformanceTests

__all__ = ["TierConformanceTests", "make_record", "random_key", "small_shape"]


def __getattr__(name: str) -> Any:
    if name == "TierConformanceTests":
        from .conformance import TierConformanceTests

        return TierConformanceTests
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
