"""Byte sizes as people write them, one syntax for every ``*_bytes`` setting and size flag.

``16Gi`` / ``16GiB`` (binary, 2^30) and ``16G`` / ``16GB`` (decimal, 10^9, as Kubernetes
quantities and the Helm chart read them); K, M, G, T, P with or without ``i`` and ``B``, any
letter case; a plain integer is bytes. Fractions are allowed when the result is a whole number
of bytes (``1.5Gi``).
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal, InvalidOperation

_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"(?P<num>-?\d+(?:\.\d*)?|-?\.\d+)\s*(?:(?P<unit>[kmgtp])(?P<bin>i)?)?b?", re.IGNORECASE)
HINT = "bytes, or a size such as 512Mi, 16GiB, 100GB"


def parse_size(value: int | float | str) -> int:
    """Bytes in ``value``; ``ValueError`` naming the accepted forms when it is not a size."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r} ({HINT})")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError(f"not a whole number of bytes: {value!r}")
    m = _SIZE.fullmatch(str(value).strip().replace("_", ""))
    if not m:
        raise ValueError(f"not a size: {value!r} ({HINT})")
    try:
        number = Decimal(m["num"])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimal numbers
        raise ValueError(f"not a size: {value!r} ({HINT})") from None
    unit = (1024 if m["bin"] else 1000) ** _POWER[(m["unit"] or "").lower()]
    size = number * unit
    if size != size.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {value!r}")
    return int(size)


def size_arg(text: str) -> int:
    """``parse_size`` as an argparse ``type`` (its message instead of argparse's generic one)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


size_arg.__name__ = "size"
