"""MkDocs hook: put the state machine's transition table and state diagram into the docs.

Both are rendered from ``pgleaderlock.core.machine.TABLE`` at build time, so the page can
never drift from the code. A page asks for them with the markers
``<!-- transition-table -->`` and ``<!-- state-diagram -->`` on lines of their own.
"""

from __future__ import annotations

from typing import Any

TABLE_MARKER = "<!-- transition-table -->"
DIAGRAM_MARKER = "<!-- state-diagram -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if TABLE_MARKER not in markdown and DIAGRAM_MARKER not in markdown:
        return markdown
    # Imported here so that a page without a marker never needs the package.
    from pgleaderlock.core.machine import render_markdown, render_mermaid

    diagram = f"```mermaid\n{render_mermaid()}\n```"
    return markdown.replace(TABLE_MARKER, render_markdown()).replace(DIAGRAM_MARKER, diagram)
