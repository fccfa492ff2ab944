"""Every relative link in README.md and docs/*.md names a file or directory of the repository
(anchors are not checked); and docs/CONFIG.md's table of settings is the one the settings model
generates, so a setting cannot be added without its row."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from dynamo_tiered_kv.config import TieredKVConfig, settings_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and [text]: target; inline code and fenced blocks are left out first
_INLINE = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository (no scheme, no pure anchor)."""
    text = _CODE.sub("", _FENCE.sub("", text))
    targets = _INLINE.findall(text) + _REFERENCE.findall(text)
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def test_link_parser_finds_what_it_should() -> None:
    text = ("see [a](docs/A.md#x), [b](<B.md>), [c](https://x.org/c.md), [d](#here), `[e](E.md)`\n"
            "```\n[f](F.md)\n```\n[g]: ../G.md \"title\"\n![img](img/p.png)\n")
    assert relative_links(text) == ["docs/A.md#x", "B.md", "img/p.png", "../G.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in relative_links(doc.read_text()):
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if path and not (doc.parent / path).exists():
            broken.append(target)
    assert broken == [], f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


def test_every_setting_has_a_description() -> None:
    assert [n for n, f in TieredKVConfig.model_fields.items() if not (f.description or "").strip()] == []


def test_config_doc_table_is_the_generated_one() -> None:
    """Regenerate with ``python -m dynamo_tiered_kv.config.settings_cli --write docs/CONFIG.md``."""
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    assert settings_cli.with_settings_table(doc) == doc
    table = doc[doc.index(settings_cli.TABLE_BEGIN):doc.index(settings_cli.TABLE_END)]
    for name in TieredKVConfig.model_fields:
        assert f"| `{name}` |" in table


def test_table_generator_refuses_a_document_without_markers() -> None:
    with pytest.raises(ValueError, match="no settings table markers"):
        settings_cli.with_settings_table("# Configuration\n")
