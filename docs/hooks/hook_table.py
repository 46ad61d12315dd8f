"""MkDocs hook: the table of lifecycle hooks, made from the `Event` enum.

`pgleaderlock.Event` is the one list of events: each member names a pluggy hook, its
arguments and the `on_*` decorator. A page asks for the table with the marker
``<!-- hook-table -->`` on a line of its own; each row shows the hook, its arguments,
the decorator with the arguments its callbacks get, and `Event.description`.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- hook-table -->"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The Markdown table, one row per `Event` member, in the enum's order."""
    # Imported here so that a page without the marker never needs the package.
    from pgleaderlock import Event

    lines = [
        "| Hook | Arguments | Decorator callback | Called when |",
        "|---|---|---|---|",
    ]
    for event in Event:
        args = ", ".join(("lock", *event.hook_args))
        called = f"`({', '.join(event.callback_args)})`" if event.callback_args else "no arguments"
        decorator = f"[`@lock.{event.decorator}`][pgleaderlock.LeaderLock.{event.decorator}]"
        callback = f"{decorator}, called with {called}"
        lines.append(
            f"| `{event.hook}` | `{args}` | {callback} "
            f"| {_cell(event.description)} |"
        )
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
