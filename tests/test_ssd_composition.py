"""The SSD tier is a facade composed of parts it owns: no mixins, no class over 40 methods, no
module over 600 lines, and no part reading another object's private attributes (read from the
source with ``ast`` where the rule is about the source)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from dynamo_tiered_kv.tiers.base import Tier
from dynamo_tiered_kv.tiers.ssd import SSDTier

SSD_PKG = Path(__file__).resolve().parents[1] / "dynamo_tiered_kv" / "tiers" / "ssd"
MAX_METHODS = 40
MAX_LINES = 600


def _members(cls: type) -> list[str]:
    """Functions and properties a class defines itself (public and private)."""
    return [name for name, v in vars(cls).items()
            if inspect.isfunction(v) or isinstance(v, (property, staticmethod, classmethod))]


def test_ssd_tier_derives_from_tier_alone() -> None:
    assert SSDTier.__bases__ == (Tier,)


def test_ssd_tier_brings_at_most_40_methods_beyond_the_contract() -> None:
    # Every class between SSDTier and Tier in the MRO counts: a mixin's methods are the tier's.
    own = SSDTier.__mro__[:SSDTier.__mro__.index(Tier)]
    names = {name for cls in own for name in _members(cls)}
    assert len(names) <= MAX_METHODS, sorted(names)


def _classes() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for f in sorted(SSD_PKG.glob("*.py")):
        out += [(f.name, n) for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ClassDef)]
    return out


def test_no_mixin_and_no_class_over_40_methods_in_the_ssd_package() -> None:
    classes = _classes()
    assert any(c.name == "SSDTier" for _, c in classes)
    for fname, c in classes:
        assert "Mixin" not in c.name, (fname, c.name)
        methods = [n for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert len(methods) <= MAX_METHODS, (fname, c.name, len(methods))


def test_no_ssd_module_over_600_lines() -> None:
    for f in sorted(SSD_PKG.glob("*.py")):
        assert len(f.read_text().splitlines()) <= MAX_LINES, f.name


def test_parts_touch_no_other_objects_private_attributes() -> None:
    """``x._name`` only on ``self``: a part reaches another part (or the shared state) through
    its public methods and fields."""
    found = []
    for f in sorted(SSD_PKG.glob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
                found.append(f"{f.name}:{n.lineno}: {ast.unparse(n)}")
    assert not found, found
