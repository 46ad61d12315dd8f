"""How a command ends: the exit codes, and the one-line error printed for bad input.

The table of codes is in the package docstring (`pgleaderlock.cli`) and in
``pgleaderlock --help``; the codes themselves live below the command line
(``pgleaderlock._exitcodes``), where Django's commands find them too.
"""

from __future__ import annotations

import click

from .._exitcodes import (
    EXIT_CANNOT_EXECUTE,
    EXIT_HELD,
    EXIT_LOST,
    EXIT_NOT_ACQUIRED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    signal_exit,
)
from ..lowlevel import first_line, mask_dsn, printable

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
