"""How a command ends: the exit codes, and the one-line error printed for bad input.

The table of codes is in the package docstring (`pgleaderlock.cli`) and in
``pgleaderlock --help``.
"""

from __future__ import annotations

import signal

import click

from ..core._logging import mask_dsn
from ..core.text import printable

__all__ = [
    "EXIT_CANNOT_EXECUTE",
    "EXIT_HELD",
    "EXIT_LOST",
    "EXIT_NOT_ACQUIRED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliError",
    "first_line",
    "signal_exit",
]

EXIT_OK = 0
EXIT_NOT_ACQUIRED = 1
EXIT_USAGE = 2
EXIT_HELD = 75  # EX_TEMPFAIL from sysexits.h: "try again later"
EXIT_LOST = 76
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


class CliError(click.ClickException):
    """A one-line error for the user; the command exits with ``exit_code`` (2).

    Passwords are masked. Messages put a DSN last: a masked ``password=***`` swallows
    what follows it up to the next space. A message may quote the server, or a name
    another role chose: control, bidi and separator characters are shown escaped
    (`pgleaderlock.core.text.printable`).
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(printable(" ".join(mask_dsn(message).split())))
        ctx = click.get_current_context(silent=True)
        self.where = ctx.command_path if ctx is not None else "pgleaderlock"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (printable: a server's message may quote
    another role's names), or its type name when it has none."""
    text = str(exc).strip()
    return printable(text.splitlines()[0]) if text else type(exc).__name__


def signal_exit(sig: signal.Signals) -> int:
    """The shell's exit code for "stopped by ``sig``": 128 + N."""
    return 128 + int(sig)
