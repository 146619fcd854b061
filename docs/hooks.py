"""mkdocs hook: replaces the reference marker with the generated configuration reference."""

from __future__ import annotations

from typing import Any

from kvtier.cli.docs_reference import config_reference

MARKER = "<!-- kvtier:config-reference -->"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, config_reference())
    return markdown
