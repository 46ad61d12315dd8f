"""``pgleaderlock sql``: the statements that create the library's tables and grant a
role what it needs, for a migration, so that the role needs no ``CREATE`` anywhere.

The same text ships as ``pgleaderlock/setup.sql`` (the defaults: schema ``public``, no
role); a test keeps the two equal.
"""

from __future__ import annotations

import click

from ..coordination.workers import CheckpointTable
from ..lowlevel import DEFAULT_SCHEMA, ConfigurationError, ParticipantTable, TermTable, quoted
from ..schedule.ledger import RunTable, ScheduleTable, WorkerRunTable
from .exits import EXIT_OK, CliError
from .options import schema_option

__all__ = ["setup_sql", "sql"]

_ROLE_PLACEHOLDER = "app_role"


def setup_sql(
    schema: str = DEFAULT_SCHEMA,
    role: str | None = None,
    terms_table: str = TermTable.name,
    checkpoint_table: str = CheckpointTable.name,
    runs_table: str = RunTable.name,
    schedules_table: str = ScheduleTable.name,
    participants_table: str = ParticipantTable.name,
    worker_role: str | None = None,
) -> str:
    """The statements: the tables (``IF NOT EXISTS``), then the grants to ``role``
    (commented out, with a placeholder, when ``None``), and to ``worker_role`` what a
    worker's [`SlotGuard`][pgleaderlock.schedule.SlotGuard] needs (Celery's
    ``SlotTask``): reading five columns of the runs and updating three
    ([`WORKER_COLUMNS`][pgleaderlock.schedule.ledger.WORKER_COLUMNS]), after revoking
    whatever else it had on them.

    Raises:
        ConfigurationError: a name that is not a plain identifier.
    """
    terms = TermTable(terms_table, schema)
    checkpoints = CheckpointTable(checkpoint_table, schema)
    runs = RunTable(runs_table, schema)
    schedules = ScheduleTable(schedules_table, schema)
    participants = ParticipantTable(participants_table, schema)
    grantee = role if role is not None else _ROLE_PLACEHOLDER
    lines = [
        "-- pgleaderlock: the library's tables, made beforehand by a migration (run it as",
        "-- the role that is to own them; the library trusts a table only when its owner is",
        "-- the lock's own role, a superuser, or a role named in trusted_roles).",
        "-- The lock's role then needs no CREATE anywhere: only what is granted below.",
        "",
        *(
            []
            if schema == DEFAULT_SCHEMA
            else [f"CREATE SCHEMA IF NOT EXISTS {quoted(schema)};", ""]
        ),
        "-- Fencing terms (LeaderLock(..., fencing=True), Coordinator(..., fencing=True)).",
        terms.create + ";",
        "",
        "-- Checkpoints of a Coordinator's named workers (one row per '<group>:<name>').",
        checkpoints.create + ";",
        "",
        "-- The schedule ledger (pgleaderlock.schedule.Scheduler, the Celery beat and",
        "-- APScheduler integrations, pgleaderlock cron): one row per (schedule, slot),",
        "-- and one per schedule. The runs' outcome is CHECKed; their row-level security",
        "-- holds a worker's role (pgleaderlock sql --worker-role) to recording 'executed'.",
        "-- Run again on an existing install, it adds what an older version lacked.",
        runs.create + ";",
        schedules.create + ";",
        "",
        "-- What locks publish about themselves (LeaderLock(..., metadata=, identity=,",
        "-- priority=, eligible=False)): row-level security lets a session write only its",
        "-- own rows.",
        participants.create + ";",
        "",
    ]
    grants = [checkpoints.grant_usage(grantee)]
    tables = (terms, checkpoints, runs, schedules, participants)
    grants += [table.grant(grantee) for table in tables]
    if role is None:
        lines.append(f"-- Then, for the role that runs the locks (here {_ROLE_PLACEHOLDER}):")
        lines += [f"-- {grant};" for grant in grants]
    else:
        lines.append(f"-- What the role {role} needs:")
        lines += [f"{grant};" for grant in grants]
    if worker_role is not None:
        worker = WorkerRunTable(runs_table, schema)
        lines += [
            "",
            f"-- What the role {worker_role} needs to run the tasks of a slot once (SlotTask):",
            "-- five columns to read and three to write, nothing else (REVOKE first: it also",
            "-- takes back what an older version granted, UPDATE on every column). The",
            "-- table's row-level security lets a role that may not INSERT record only",
            "-- 'executed', on a slot that is running, sent, failed or lost.",
            f"{worker.grant_usage(worker_role)};",
            f"REVOKE ALL ON {worker.sql} FROM {quoted(worker_role)};",
            f"{worker.grant(worker_role)};",
        ]
    return "\n".join(lines) + "\n"


@click.command("sql")
@schema_option
@click.option("--role", help="The role that runs the locks: print its GRANTs.")
@click.option(
    "--worker-role",
    help="A role of Celery workers whose tasks are SlotTasks: print its GRANTs.",
)
@click.option("--fencing-table", default=TermTable.name, show_default=True)
@click.option("--checkpoint-table", default=CheckpointTable.name, show_default=True)
@click.option("--runs-table", default=RunTable.name, show_default=True)
@click.option("--schedules-table", default=ScheduleTable.name, show_default=True)
@click.option("--participants-table", default=ParticipantTable.name, show_default=True)
def sql(
    schema: str,
    role: str | None,
    fencing_table: str,
    checkpoint_table: str,
    runs_table: str,
    schedules_table: str,
    participants_table: str,
    worker_role: str | None,
) -> int:
    """Print the SQL that creates the library's tables and grants a role what it needs.

    For a migration: run it as the role that is to own the tables; the role that runs
    the locks then needs no CREATE anywhere.
    """
    try:
        text = setup_sql(
            schema,
            role,
            fencing_table,
            checkpoint_table,
            runs_table,
            schedules_table,
            participants_table,
            worker_role,
        )
        click.echo(text, nl=False)
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    return EXIT_OK
