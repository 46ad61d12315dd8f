"""Options the commands share, and turning them into checked values.

- which lock: ``--name`` or ``--key1``/``--key2`` (`target_options`, `Target`);
- which database: ``--dsn``, else ``$PGLEADERLOCK_DSN``, else ``$PG_DSN``;
- how to reach it: ``--backend``, ``--connect-timeout`` (`lock_options`, `Common` for the
  commands that hold the lock);
- ``--wait`` (``acquire``, ``exec``) and the log verbosity (`log_options`);
- where the library's tables are and whom to trust for them: ``--schema`` and
  ``--trusted-role`` (`table_options`, `Tables`; each also alone, `schema_option` and
  `trusted_role_option`), for every command that reads, checks, writes or prints them
  (``cron``, ``status``, ``doctor``, ``sql``).

Bad values raise `CliError`: one line, exit code 2.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import click

from .._env import DSN_VARIABLES
from ..lowlevel import (
    DEFAULT_SCHEMA,
    ConfigurationError,
    check_identifier,
    check_key,
    check_roles,
    lock_keys,
)
from ..lowlevel import positive as core_positive
from .exits import CliError
from .logs import setup_logging

__all__ = [
    "Common",
    "Tables",
    "Target",
    "check_wait",
    "choice_option",
    "command_of_a_command",
    "count_option",
    "lock_options",
    "log_options",
    "names_target_options",
    "positive",
    "resolve_dsn",
    "resolve_tables",
    "resolve_target",
    "schema_option",
    "seconds_option",
    "slots_option",
    "table_options",
    "target_options",
    "trusted_role_option",
    "wait_option",
]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Target:
    """The lock a command works on."""

    name: str | None
    key1: int
    key2: int


@dataclass(frozen=True)
class Common:
    """Options shared by ``run``, ``acquire`` and ``exec``."""

    dsn: str
    target: Target
    backend: str | None
    connect_timeout_s: float


@dataclass(frozen=True)
class Tables:
    """Where the library's tables are, and whom to trust for them (``--schema``,
    ``--trusted-role``): the locks' ``fencing_schema``/``participants_schema``, the
    Scheduler's ``schema``, and ``trusted_roles``."""

    schema: str
    trusted_roles: tuple[str, ...]


# ---------------------------------------------------------------------- checks


def resolve_dsn(dsn: str | None) -> str:
    """``dsn``, or a `CliError` when it is missing or blank."""
    if dsn is None or not dsn.strip():
        raise CliError(
            "no DSN: pass --dsn or set PGLEADERLOCK_DSN or PG_DSN (e.g. postgresql://user@host/db)"
        )
    return dsn


def resolve_target(name: str | None, key1: int | None, key2: int | None) -> Target:
    """The lock named by ``--name``, or by ``--key1`` and ``--key2`` (not both ways)."""
    if name is not None and (key1 is not None or key2 is not None):
        raise CliError("name the lock with either --name or --key1/--key2, not both")
    if name is not None:
        try:
            key1, key2 = lock_keys(name)
        except ConfigurationError as exc:
            raise CliError(str(exc)) from None
        return Target(name, key1, key2)
    if key1 is None and key2 is None:
        raise CliError("which lock? pass --name NAME, or --key1 K1 --key2 K2")
    if key1 is None or key2 is None:
        raise CliError("--key1 and --key2 go together (or use --name)")
    try:
        return Target(None, check_key("--key1", key1), check_key("--key2", key2))
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None


def positive(option: str, value: float) -> float:
    """``value`` if it is a finite number of seconds above zero (the library's rule)."""
    try:
        return core_positive(option, value)
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None


def resolve_tables(schema: str, trusted_roles: tuple[str, ...]) -> Tables:
    """``--schema`` and ``--trusted-role``, checked as the library checks them."""
    try:
        return Tables(check_identifier("--schema", schema), check_roles(trusted_roles))
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None


def check_wait(wait_s: float) -> float:
    """``--wait``: zero (a single attempt), a number of seconds, or ``inf``."""
    if wait_s < 0 or math.isnan(wait_s):
        raise CliError(f"--wait must be >= 0, got {wait_s:g}")
    return wait_s


# ---------------------------------------------------------------------- decorators


def seconds_option(*names: str, default: float | None, text: str) -> Callable[[F], F]:
    """A ``--NAME SECONDS`` option (a float; its default shown in ``--help`` if it has one).

    Args:
        *names: the option's names (and its parameter name), as for ``click.option``.
        default: the default, or None (the option is off when omitted).
        text: the help text.
    """
    return click.option(
        *names,
        type=float,
        default=default,
        show_default=default is not None,
        metavar="SECONDS",
        help=text,
    )


def choice_option(name: str, choices: list[str], *, default: str, text: str) -> Callable[[F], F]:
    """A ``--NAME`` option that takes one of ``choices`` (its default shown in ``--help``)."""
    return click.option(
        name, type=click.Choice(choices), default=default, show_default=True, help=text
    )


def count_option(
    name: str, *, minimum: int, default: int, text: str, maximum: int | None = None
) -> Callable[[F], F]:
    """A ``--NAME N`` option: a whole number of at least ``minimum`` (and at most
    ``maximum``, if given; its default shown in ``--help``)."""
    return click.option(
        name, type=click.IntRange(minimum, maximum), default=default, show_default=True, help=text
    )


def dsn_option(text: str) -> Callable[[F], F]:
    """``--dsn DSN``, from ``PGLEADERLOCK_DSN`` or ``PG_DSN`` when omitted (the variables
    shown in ``--help``); ``text`` says what it connects to."""
    return click.option(
        "--dsn", envvar=list(DSN_VARIABLES), show_envvar=True, metavar="DSN", help=text
    )


def command_of_a_command(name: str, epilog: str) -> Callable[[F], click.Command]:
    """``click.command`` for a command that runs ``COMMAND [ARGS]...``: whatever follows
    COMMAND is COMMAND's, options included."""
    return click.command(
        name,
        epilog=epilog,
        context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    )


def _apply(f: F, options: list[Callable[[F], F]]) -> F:
    for option in reversed(options):  # the first option is listed first in --help
        f = option(f)
    return f


def _target_option_list(*, many_names: bool) -> list[Any]:
    name_help = (
        "Lock name; the keys are derived from it exactly as "
        "('x'||substr(md5(NAME),1,8))::bit(32)::int and (…,9,8) in SQL."
    )
    if many_names:
        name_help += " With --group: a name of the group's workers (repeatable)."
    return [
        dsn_option(
            "PostgreSQL connection string (URL or key=value). Prefer the environment or "
            "~/.pgpass to a password on the command line. A postgresql+DRIVER:// "
            "scheme selects the backend."
        ),
        click.option("--name", metavar="NAME", multiple=many_names, help=name_help),
        click.option("--key1", type=int, metavar="INT", help="Advisory lock key 1 (int4)."),
        click.option("--key2", type=int, metavar="INT", help="Advisory lock key 2 (int4)."),
    ]


def target_options(f: F) -> F:
    """``--dsn``, ``--name``, ``--key1``, ``--key2``."""
    return _apply(f, _target_option_list(many_names=False))


def names_target_options(f: F) -> F:
    """[`target_options`][pgleaderlock.cli.options.target_options] with a repeatable
    ``--name`` (the command gets a tuple of names): ``status``, whose ``--group`` takes
    several names."""
    return _apply(f, _target_option_list(many_names=True))


def lock_options(f: F) -> F:
    """[`target_options`][pgleaderlock.cli.options.target_options], then `--backend` and
    `--connect-timeout`. The command gets them checked, as one argument
    `common: Common`."""

    @functools.wraps(f)
    def command(
        *,
        dsn: str | None,
        name: str | None,
        key1: int | None,
        key2: int | None,
        backend: str | None,
        connect_timeout: float,
        **options: Any,
    ) -> Any:
        common = Common(
            dsn=resolve_dsn(dsn),
            target=resolve_target(name, key1, key2),
            backend=backend,
            connect_timeout_s=positive("--connect-timeout", connect_timeout),
        )
        return f(common=common, **options)

    decorated = _apply(
        cast(F, command),
        [
            click.option(
                "--backend",
                metavar="NAME",
                help="Driver backend (psycopg, asyncpg, sqlalchemy); default from the DSN "
                "scheme, else psycopg.",
            ),
            seconds_option(
                "--connect-timeout",
                default=5.0,
                text="Timeout for opening a database session.",
            ),
        ],
    )
    return target_options(decorated)


def schema_option(f: F) -> F:
    """``--schema SCHEMA`` (default ``public``): the schema of the library's tables; the
    command gets it as ``schema``."""
    return click.option(
        "--schema",
        metavar="SCHEMA",
        default=DEFAULT_SCHEMA,
        show_default=True,
        help="The schema of the library's tables (fencing terms, schedule ledger, "
        "participants, checkpoints): the locks' fencing_schema and participants_schema. "
        "Give the same one to every command and process that uses them.",
    )(f)


def trusted_role_option(f: F) -> F:
    """``--trusted-role ROLE`` (repeatable): the command gets a tuple ``trusted_roles``."""
    return click.option(
        "--trusted-role",
        "trusted_roles",
        metavar="ROLE",
        multiple=True,
        help="A role trusted besides yours and superusers (repeatable), as trusted_roles: "
        "the library's tables are used only if a trusted role owns them and their "
        "schema (e.g. the migration role that ran pgleaderlock sql), and only sessions "
        "of trusted roles count as the lock's or a group's.",
    )(f)


def table_options(f: F) -> F:
    """[`schema_option`][pgleaderlock.cli.options.schema_option] and
    [`trusted_role_option`][pgleaderlock.cli.options.trusted_role_option]; the command
    gets them checked, as one argument ``tables: Tables``."""

    @functools.wraps(f)
    def command(*, schema: str, trusted_roles: tuple[str, ...], **options: Any) -> Any:
        return f(tables=resolve_tables(schema, trusted_roles), **options)

    return _apply(cast(F, command), [schema_option, trusted_role_option])


def slots_option(f: F) -> F:
    """``-n/--slots N`` (``exec``): a [`Semaphore`][pgleaderlock.Semaphore] of N slots
    instead of a lock (1: a lock)."""
    return click.option(
        "-n",
        "--slots",
        "slots",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        metavar="N",
        help="Run COMMAND on at most N hosts at once (a semaphore of N slots named by "
        "--name; every host must give the same N). 1: a singleton.",
    )(f)


def wait_option(f: F) -> F:
    """``--wait SECONDS`` (``acquire``, ``exec``); check it with `check_wait`."""
    return seconds_option(
        "--wait",
        "wait_s",
        default=0.0,
        text="Wait up to SECONDS for the lock if it is held elsewhere (inf: forever). "
        "0 makes a single attempt.",
    )(f)


def log_options(cli: str, library: str) -> Callable[[F], F]:
    """`-v`, `-q`, `--log-json`: logging is set up from them before the command runs.

    Args:
        cli: the command's own log threshold without `-v`/`-q`.
        library: the library's log threshold without `-v`/`-q`.
    """

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def command(*, verbose: int, quiet: int, log_json: bool, **options: Any) -> Any:
            setup_logging(cli, library, verbose, quiet, log_json)
            return f(**options)

        return _apply(
            cast(F, command),
            [
                click.option(
                    "-v", "--verbose", count=True, help="More log output (repeat for debug)."
                ),
                click.option("-q", "--quiet", count=True, help="Less log output."),
                click.option(
                    "--log-json", is_flag=True, help="Log one JSON object per line (to stderr)."
                ),
            ],
        )

    return decorate
