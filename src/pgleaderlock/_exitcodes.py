"""The exit codes of the command line and of Django's management commands (the table is
in `pgleaderlock.cli`'s docstring and in ``pgleaderlock --help``).

They live below both, with nothing else: Django's ``pgleaderlock_status`` uses them
without loading the command line's libraries (click, loguru).
"""

from __future__ import annotations

import signal

__all__ = [
    "EXIT_CANNOT_EXECUTE",
    "EXIT_HELD",
    "EXIT_LOST",
    "EXIT_NOT_ACQUIRED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "signal_exit",
]

EXIT_OK = 0
EXIT_NOT_ACQUIRED = 1
EXIT_USAGE = 2
EXIT_HELD = 75  # EX_TEMPFAIL from sysexits.h: "try again later"
EXIT_LOST = 76
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


def signal_exit(sig: signal.Signals) -> int:
    """The shell's exit code for "stopped by ``sig``": 128 + N."""
    return 128 + int(sig)
