"""The ``pgleaderlock`` command line: ``run``, ``acquire``, ``exec``, ``cron``,
``status``, ``sql`` (the tables and grants, for a migration), ``doctor`` (is this
database a safe place for the locks?) and ``dashboard`` (a live web page of who leads
what).

Install it with ``pip install 'pgleaderlock[cli]'`` (click and loguru). Every command
works on one lock, named with ``--name`` (keys derived by [`lock_keys`][pgleaderlock.lock_keys])
or given as ``--key1``/``--key2``; the database comes from ``--dsn``, else
``$PGLEADERLOCK_DSN``, else ``$PG_DSN``.

The library logs on the stdlib logger ``pgleaderlock``; the CLI routes that logger into
loguru (`InterceptHandler`) and writes every line to stderr, so that stdout
belongs to ``status`` output and to the command that ``exec`` runs.

This package holds the click group and the entry point; one module per command (`run`,
`acquire`, `exec`, `cron`, `status`, `sql`, `doctor`), and what they share:
`options`, `logs`, `exits`, `runtime`, `retry`, `tracker`.

Exit codes (also in ``pgleaderlock --help``):

| Code | Meaning |
|---|---|
| 0 | success; ``run`` stopped by SIGTERM/SIGINT (lock released) |
| 1 | ``acquire``: held elsewhere; ``run``: the lock stopped by itself; ``doctor``: a check failed |
| 2 | bad input (no or malformed DSN, keys out of range, ...), unreachable or refusing server |
| 75 | ``exec``: the lock is held elsewhere, COMMAND was not run (``--held-exit-code``) |
| 76 | ``exec``/``acquire --hold``: leadership was lost; COMMAND was terminated |
| 126 | ``exec``: COMMAND cannot be executed; 127: COMMAND not found |
| 128+N | killed by / stopped on signal N before COMMAND ran (130 SIGINT, 143 SIGTERM) |
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from .._extras import needs_extra

with needs_extra("the pgleaderlock command line", "click and loguru", "cli"):
    import click
    import loguru  # noqa: F401 - checked here, so that a missing extra fails in one place

from .. import __version__
from ..lowlevel import mask_dsn, printable
from . import exits
from .acquire import acquire
from .cron import cron
from .dashboard import dashboard
from .doctor import doctor
from .exec import exec_
from .exits import *  # noqa: F403 - its exit codes, EXIT_*, are this package's too
from .exits import EXIT_OK, CliError, signal_exit
from .logs import InterceptHandler, configure_logging
from .run import run
from .sql import sql
from .status import status

__all__ = [
    *(name for name in exits.__all__ if name.startswith("EXIT_")),
    "InterceptHandler",
    "cli",
    "configure_logging",
    "main",
    "run_cli",
]

_MAIN_EPILOG = """\b
Examples:
  export PG_DSN=postgresql://app@db.internal/app
  pgleaderlock run --name billing-scheduler          # take part in an election, log it
  pgleaderlock acquire --name nightly-report         # one try: exit 0 if acquired, 1 if not
  pgleaderlock exec --name nightly-report -- ./report.sh   # run only if nobody else does
  pgleaderlock cron --name backup --schedule "0 3 * * *" -- ./backup.sh  # once per slot
  pgleaderlock status --name billing-scheduler       # who holds it, who waits
  pgleaderlock status --all --json                   # every advisory lock, for scripts
  pgleaderlock sql --role app > pgleaderlock.sql     # tables and grants, for a migration
  pgleaderlock doctor --locks 30 --replicas 3        # is this database safe for the plan?
  pgleaderlock dashboard                             # who leads what, live: http://127.0.0.1:8800/

\b
Exit codes:
  0      success; run, cron: stopped by SIGTERM/SIGINT (the lock was released)
  1      acquire: the lock is held elsewhere; run, cron: the lock stopped by itself;
         doctor: a check failed (--strict: or warned)
  2      bad input (no or malformed DSN, keys out of range, ...), unreachable server,
         or refused for good (authentication, unknown role or database, pooler)
  75     exec: the lock is held elsewhere, COMMAND did not run (--held-exit-code)
  76     exec, acquire --hold: leadership was lost (COMMAND was terminated)
  126    exec, cron: COMMAND cannot be executed (127: not found)
  128+N  stopped by signal N before COMMAND ran (130: SIGINT, 143: SIGTERM)

Logs go to stderr; stdout carries only status output and the output of COMMAND.
"""


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=_MAIN_EPILOG,
)
@click.version_option(__version__, "--version", prog_name="pgleaderlock")
def cli() -> None:
    """Leader election and singleton jobs on PostgreSQL session-level advisory locks.

    Every command works on one lock: name it with --name NAME (the two keys are
    derived from the name, so every process and SQL agree), or give the keys with
    --key1/--key2. The database comes from --dsn, else $PGLEADERLOCK_DSN, else
    $PG_DSN.
    """


for _command in (run, acquire, exec_, cron, status, sql, doctor, dashboard):
    cli.add_command(_command)


def run_cli(args: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code (no ``sys.exit``).

    Args:
        args: the arguments; default ``sys.argv[1:]``.
    """
    try:
        result = cli.main(
            args=list(args) if args is not None else None,
            prog_name="pgleaderlock",
            standalone_mode=False,
        )
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.format_message())
        return EXIT_OK
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "pgleaderlock"
        message = printable(" ".join(mask_dsn(exc.format_message()).split()))
        click.echo(f"{where}: error: {message} (see '{where} --help')", err=True)
        return exc.exit_code
    except CliError as exc:
        click.echo(f"{exc.where}: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        message = printable(" ".join(mask_dsn(exc.format_message()).split()))
        click.echo(f"pgleaderlock: error: {message}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        return signal_exit(signal.SIGINT)
    except KeyboardInterrupt:
        return signal_exit(signal.SIGINT)
    return result if isinstance(result, int) else EXIT_OK


def main() -> NoReturn:
    """The ``pgleaderlock`` console script."""
    sys.exit(run_cli())
