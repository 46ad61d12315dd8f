"""MkDocs hook: put the state machine's transition table into the docs.

The table is rendered from ``pgleaderlock.core.machine.TABLE`` at build time, so the
page can never drift from the code. A page asks for it with the marker
``<!-- transition-table -->`` on a line of its own.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- transition-table -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    # Imported here so that a page without the marker never needs the package.
    from pgleaderlock.core.machine import render_markdown

    return markdown.replace(MARKER, render_markdown())
