"""``pgleaderlock status --watch``: the status report kept on screen, redrawn when it
changes.

It reads the report every ``--interval`` seconds on one connection (``status``'s
`Reader`: bounded as every status query, opened again after an error) and redraws only
when what it says changes: who holds the lock, who waits, members, schedules... The
report's clock fields (``checked_at``, the ``*_age_s`` ages, a session's momentary
``state``) do not count as changes. The text is ``status``'s own layout
(`pgleaderlock.status.render`), so whatever a report carries is shown.

The drawing is [rich](https://rich.readthedocs.io)'s ``Live`` display, from the ``tui``
extra (``pip install 'pgleaderlock[tui]'``); without it ``--watch`` says which extra to
install. Ctrl-C ends the watch with exit code 0, leaving the last frame on screen; an
error (the server went away) is shown in the frame and the watch goes on reading.

What the frame shows is any role's text (``application_name``, identities, a run's
outcome and detail): the renderers make every string printable
(`pgleaderlock.core.text.printable_tree`), each line is made so once more here, and the
body is a rich ``Text``, never markup, so a ``[bold]`` in a row is shown as written
(nothing to ``rich.markup.escape``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from .._extras import missing_extra
from ..lowlevel import printable
from ..status.render import fingerprint
from .exits import EXIT_OK, CliError

__all__ = ["watch_status"]


def watch_status(
    read: Callable[[], Mapping[str, Any]],
    text: Callable[[Mapping[str, Any]], str],
    interval_s: float,
) -> int:
    """Show ``text(read())`` until Ctrl-C, redrawn when the report changes.

    Args:
        read: the report now (raises `CliError` when it cannot be read).
        text: the report's text layout.
        interval_s: seconds between reads.

    Returns:
        0 (Ctrl-C is the way to end it).
    """
    try:
        from rich.console import Console
        from rich.live import Live
        from rich.panel import Panel
        from rich.text import Text
    except ImportError as exc:
        raise CliError(
            str(missing_extra("pgleaderlock status --watch", "rich", "tui", exc))
        ) from None

    console = Console()
    last: str | None = None
    changes = 0

    def frame(body: str, error: bool, changed_at: datetime) -> Panel:
        safe = "\n".join(printable(line) for line in body.split("\n"))
        shown = Text(safe, style="bold red" if error else "")  # literal text, no markup
        subtitle = (
            f"read every {interval_s:g} s · {changes} change{'s' if changes != 1 else ''} seen"
            f" · last at {changed_at:%H:%M:%S} · Ctrl-C quits"
        )
        return Panel(shown, title="pgleaderlock status --watch", subtitle=subtitle)

    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                try:
                    report = read()
                    body, key, error = text(report), fingerprint(report), False
                except CliError as exc:
                    body = f"cannot read the status: {exc.format_message()} (retrying)"
                    key, error = f"error: {body}", True
                if key != last:
                    changes += last is not None
                    last = key
                    live.update(frame(body, error, datetime.now()), refresh=True)
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return EXIT_OK
