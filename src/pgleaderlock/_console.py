"""The ``pgleaderlock`` console script's entry point.

It imports the command line lazily, so that an installation without the ``cli`` extra
answers with one line naming the extra instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import NoReturn


def main() -> NoReturn:
    """Run `pgleaderlock.cli.main`, or explain in one line what to install."""
    try:
        from .cli import main as cli_main
    except ImportError as exc:
        print(f"pgleaderlock: {exc}", file=sys.stderr)
        sys.exit(2)
    cli_main()
