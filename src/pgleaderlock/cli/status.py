"""``pgleaderlock status``: who holds the lock now, and who waits for it; with
``--group``, who leads what in a [`Coordinator`][pgleaderlock.Coordinator]'s group.

The command parses its options, reads the report with the read model
(`pgleaderlock.status`: one short psycopg connection, every statement bounded) and
prints it: as text (`pgleaderlock.status.render`), as JSON (``--json``, the report
itself), or redrawn as it changes (``--watch``, `pgleaderlock.cli.watch`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import click
import psycopg

from ..coordination.protocol import check_group, name_keys
from ..coordination.workers import CheckpointTable
from ..lowlevel import ConfigurationError, ConnectionError, ParticipantTable, check_roles
from ..schedule.ledger import RunTable, ScheduleTable
from ..status import (
    add_participants,
    all_locks_report,
    bounded,
    checkpoint_names,
    group_report,
    lock_report,
    open_connection,
    schedule_report,
    server_info,
)
from ..status.render import json_default, render_all, render_group, render_one
from .exits import EXIT_OK, CliError, first_line
from .options import (
    Target,
    log_options,
    names_target_options,
    positive,
    resolve_dsn,
    resolve_target,
    schema_option,
    seconds_option,
    trusted_role_option,
)

__all__ = ["Reader", "status"]

_STATUS_EPILOG = """\b
Examples:
  pgleaderlock status --name billing-scheduler
  pgleaderlock status --key1 1234 --key2 5678 --json | jq .holders[0].pid
  pgleaderlock status --all
  pgleaderlock status --name billing-scheduler --watch   # redrawn as leadership changes
  pgleaderlock status --group billing
  pgleaderlock status --group billing --name projection:users --name saga:fulfillment --json

Informational: it shows what pg_locks says at this instant. Only followers that wait
on the server (--follower-mode wait, the default) are counted as waiting; polling
followers hold no row in pg_locks between attempts.
"""


@click.command("status", epilog=_STATUS_EPILOG)
@names_target_options
@click.option("--all", "all_locks", is_flag=True, help="List every advisory lock in the database.")
@click.option(
    "--group",
    metavar="GROUP",
    help="Who leads what in a Coordinator's group: its members and their sessions, each "
    "name's leader and waiting members. Names are shown for the --name values, the "
    "checkpoint table's rows and plain pgleaderlock locks; other locks by their keys.",
)
@click.option(
    "--checkpoint-table",
    metavar="TABLE",
    default="pgleaderlock_subscriptions",
    show_default=True,
    help="With --group: the table of checkpoints whose rows of the group give names "
    "(if it exists, can be read, and a trusted role owns it and its schema).",
)
@click.option(
    "--checkpoint-schema",
    metavar="SCHEMA",
    help="With --group: the checkpoint table's schema (default: --schema).",
)
@schema_option
@trusted_role_option
@click.option(
    "--schedule-schema",
    metavar="SCHEMA",
    help="With --name: the schema of the schedule ledger, whose schedules of the lock "
    "are shown (next slot, outcomes, last runs); default: --schema.",
)
@click.option(
    "--runs",
    "last_runs",
    type=click.IntRange(0, 1000),
    default=5,
    show_default=True,
    help="With --name: how many of each schedule's last runs to show.",
)
@click.option(
    "--participants-schema",
    metavar="SCHEMA",
    help="With --name or --key1/--key2: the schema of the participants table, whose live "
    "rows give each session's identity, priority and metadata, and the observers; "
    "default: --schema.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
@click.option(
    "--watch",
    is_flag=True,
    help="Keep the report on screen, redrawn when it changes (who leads, who waits); "
    "without --name, --group or --key1/--key2: every advisory lock. Ctrl-C ends it "
    "(exit 0). Needs the tui extra: pip install 'pgleaderlock[tui]'.",
)
@seconds_option("--interval", default=1.0, text="With --watch: how often to read the server.")
@seconds_option("--timeout", default=5.0, text="Connect timeout and statement timeout.")
@log_options(cli="WARNING", library="WARNING")
def status(
    dsn: str | None,
    name: tuple[str, ...],
    key1: int | None,
    key2: int | None,
    all_locks: bool,
    group: str | None,
    checkpoint_table: str,
    checkpoint_schema: str | None,
    schema: str,
    trusted_roles: tuple[str, ...],
    schedule_schema: str | None,
    last_runs: int,
    participants_schema: str | None,
    as_json: bool,
    watch: bool,
    interval: float,
    timeout: float,
) -> int:
    """Show who holds the lock now and how many sessions wait for it.

    Reads pg_locks joined with pg_stat_activity: the holder's backend pid,
    application_name (pgleaderlock sets it to pgleaderlock:NAME@HOST:PID; a
    Coordinator's sessions to pgl:GROUP:MEMBER:ROLE), client address, user, when its
    session started and when its state last changed; then the sessions waiting for the
    lock; with --name, also the lock's schedules in the schedule ledger (pgleaderlock
    cron, Scheduler, Celery beat): next slot, outcomes and last runs. --all lists every
    advisory lock held or awaited in the database, with two-key locks decoded back to
    signed key1/key2. --group shows who leads what in a Coordinator's group.
    """
    dsn = resolve_dsn(dsn)
    checkpoint_schema = checkpoint_schema or schema
    schedule_schema = schedule_schema or schema
    participants_schema = participants_schema or schema
    target: Target | None = None
    if group is not None:
        if all_locks or key1 is not None or key2 is not None:
            raise CliError("--group names the locks with --name: leave out --all/--key1/--key2")
        try:
            group = check_group(group)
            names = {name_keys(group, n): n for n in name}
            table = CheckpointTable(checkpoint_table, checkpoint_schema, trusted_roles)
        except ConfigurationError as exc:
            raise CliError(str(exc)) from None
    elif len(name) > 1:
        raise CliError("one --name, or several with --group")
    elif all_locks:
        if name or key1 is not None or key2 is not None:
            raise CliError("--all lists every lock: leave out --name/--key1/--key2")
    elif watch and not name and key1 is None and key2 is None:
        pass  # every lock
    else:
        target = resolve_target(name[0] if name else None, key1, key2)
    timeout = positive("--timeout", timeout)
    try:
        trusted_roles = check_roles(trusted_roles)
        participants = ParticipantTable(schema=participants_schema, trusted_roles=trusted_roles)
        ledger = (
            RunTable(schema=schedule_schema, trusted_roles=trusted_roles),
            ScheduleTable(schema=schedule_schema, trusted_roles=trusted_roles),
        )
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None

    def build(conn: psycopg.Connection[Any]) -> Mapping[str, Any]:
        try:
            info = server_info(conn, trusted_roles)
            if group is not None:
                found, skipped = checkpoint_names(conn, table, group)
                in_group = group_report(conn, info, group, {**found, **names})
                in_group["checkpoint_table"] = {"table": table.shown, "not_read": skipped}
                return in_group
            if target is not None:
                one = lock_report(conn, info, target.name, (target.key1, target.key2))
                add_participants(conn, one, participants)
                if target.name is not None:
                    one["schedules"] = schedule_report(
                        conn, *ledger, [f"{target.name}:"], last_runs
                    )
                return one
            return all_locks_report(conn, info)
        except psycopg.errors.QueryCanceled:
            raise CliError(f"the status query took longer than {timeout:g} s") from None
        except psycopg.Error as exc:
            raise CliError(f"status query failed: {first_line(exc)}") from None

    def text(report: Mapping[str, Any]) -> str:
        if group is not None:
            return render_group(report)
        if target is None:
            return render_all(report)
        return render_one(report)

    if watch:
        if as_json:
            raise CliError("--watch draws on the terminal: leave out --json")
        from .watch import watch_status  # needs the tui extra (rich)

        def build_bounded(conn: psycopg.Connection[Any]) -> Mapping[str, Any]:
            with bounded(conn, timeout):
                return build(conn)

        with Reader(lambda: _open(dsn, timeout), build_bounded) as reader:
            return watch_status(reader, text, positive("--interval", interval))
    with _open(dsn, timeout) as conn, bounded(conn, timeout):
        report = build(conn)
    click.echo(json.dumps(report, indent=2, default=json_default) if as_json else text(report))
    return EXIT_OK


class Reader:
    """A status report on demand, for ``--watch``: one connection kept between reports,
    opened again after an error (each report bounded as for ``status``)."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        build: Callable[[psycopg.Connection[Any]], Mapping[str, Any]],
    ) -> None:
        self._connect = connect
        self._build = build
        self._conn: psycopg.Connection[Any] | None = None

    def __call__(self) -> Mapping[str, Any]:
        """The report now; raises `CliError` (and drops the connection) on failure."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            return self._build(self._conn)
        except CliError:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection (if open)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(dsn: str, timeout_s: float) -> psycopg.Connection[Any]:
    """`pgleaderlock.status.open_connection`, its errors one line for the user."""
    try:
        return open_connection(dsn, timeout_s)
    except (ConfigurationError, ConnectionError) as exc:
        raise CliError(str(exc)) from None
