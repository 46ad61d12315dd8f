"""``manage.py pgleaderlock_status``: the leaders of the configured locks, and the
schedules in the ledger (their spec, next slot, recent runs and outcomes).

The locks' part is ``pgleaderlock status --name``'s (its queries and text layout, in
`pgleaderlock.cli.status` and `pgleaderlock.cli.render`): holder, waiting sessions, and
whether their roles are trusted. The ledger's part reads the tables a
`pgleaderlock.schedule.Scheduler` writes, only if they exist and can be
trusted (a plain table, owned by a trusted role, in a schema a trusted role owns:
another role's table or view could run that role's code as yours); otherwise it says
why they were not read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg

from ...backends.sql import TABLE_CHECK
from ...cli.options import Target
from ...cli.render import render_one
from ...cli.status import _connect, _one_lock, _server_info
from ...core.config import check_roles
from ...core.errors import ConfigurationError, MissingPrivilegeError
from ...core.keys import lock_keys
from ...core.tables import LibraryTable, TableCheck, TermTable
from ...schedule.ledger import OUTCOMES, Ledger
from .conf import Settings, build_dsn

__all__ = ["build_report", "render_report"]

_SCHEDULES = (
    "SELECT s.schedule, s.spec, s.since, s.next_slot, s.updated_at FROM {schedules} s"
    " UNION ALL SELECT DISTINCT r.schedule, NULL::text, NULL::timestamptz, NULL::timestamptz,"
    " NULL::timestamptz FROM {runs} r"
    " WHERE NOT EXISTS (SELECT 1 FROM {schedules} s WHERE s.schedule = r.schedule)"
    " ORDER BY 1"
)
_COUNTS = "SELECT schedule, outcome, count(*) FROM {runs} GROUP BY 1, 2"
_RUN_FIELDS = ("slot", "term", "holder", "outcome", "attempt", "claimed_at", "started_at",
               "finished_at", "detail")  # fmt: skip


def build_report(
    settings: Settings,
    names: Sequence[str],
    *,
    runs: int = 5,
    timeout_s: float = 5.0,
    schedules: Sequence[str] = (),
) -> dict[str, Any]:
    """The report: ``{"database", "checked_at", "locks": [...], "ledger": {...}}``.

    Args:
        settings: the app's settings (the database, trusted roles, the ledger's tables).
        names: the locks to show.
        runs: how many of each schedule's newest runs to show.
        timeout_s: the connect timeout and the statement timeout.
        schedules: show only the schedules whose names start with one of these
            (a schedule is named ``<lock>:<job>``); all when empty.

    Raises:
        click.ClickException: the database cannot be reached.
        psycopg.Error: a query failed (``QueryCanceled``: it took longer than
            ``timeout_s``).
        ConfigurationError: a bad lock name or trusted role.
    """
    trusted = check_roles(tuple(settings.options.get("trusted_roles", ())))
    targets = [Target(name, *lock_keys(name)) for name in names]
    with _connect(build_dsn(settings.database), timeout_s) as conn:
        info = _server_info(conn, trusted)
        return {
            "database": info.database,
            "checked_at": info.now,
            "locks": [_one_lock(conn, info, target) for target in targets],
            "ledger": _ledger(conn, settings, runs, tuple(schedules)),
        }


def _ledger(
    conn: psycopg.Connection[Any], settings: Settings, runs: int, prefixes: tuple[str, ...]
) -> dict[str, Any]:
    runs_table, schedules_table = settings.ledger_tables()
    report: dict[str, Any] = {
        "runs_table": runs_table.shown,
        "schedules_table": schedules_table.shown,
        "not_read": None,
        "schedules": [],
    }
    for table in (runs_table, schedules_table):
        why = _unreadable(conn, table)
        if why is not None:
            report["not_read"] = why
            return report
    ledger = Ledger(runs_table, schedules_table, TermTable(schema=runs_table.schema))
    counts: dict[str, dict[str, int]] = {}
    for schedule, outcome, count in conn.execute(
        _COUNTS.format(runs=runs_table.sql).encode()
    ).fetchall():
        counts.setdefault(schedule, {})[outcome] = count
    query = _SCHEDULES.format(runs=runs_table.sql, schedules=schedules_table.sql)
    recent = ledger.recent.format("%s", "%s").encode()
    for schedule, spec, since, next_slot, updated_at in conn.execute(query.encode()).fetchall():
        if prefixes and not schedule.startswith(prefixes):
            continue
        rows = conn.execute(recent, (schedule, runs)).fetchall()
        by_outcome = counts.get(schedule, {})
        report["schedules"].append(
            {
                "schedule": schedule,
                "spec": spec,
                "since": since,
                "next_slot": next_slot,
                "updated_at": updated_at,
                "outcomes": {
                    o: by_outcome[o] for o in (*OUTCOMES, *sorted(by_outcome)) if o in by_outcome
                },
                "runs": [dict(zip(_RUN_FIELDS, row, strict=True)) for row in rows],
            }
        )
    return report


def _unreadable(conn: psycopg.Connection[Any], table: LibraryTable) -> str | None:
    """Why ``table`` is not read (``None``: it may be): missing, or not trusted, or
    not readable by this role."""
    values = {"v0": table.schema, "v1": table.name, "v2": list(table.trusted_roles)}
    row = conn.execute(TABLE_CHECK.sql("%(v0)s", "%(v1)s", "%(v2)s"), values).fetchone()
    assert row is not None
    check = TableCheck(table, *row[:9])
    if check.schema_owner is None:
        return f"the schema {table.schema!r} does not exist: no Scheduler has run here yet"
    if check.relkind is None:
        return f"{table.shown} does not exist yet: no Scheduler has run here"
    try:
        check.verify()
    except MissingPrivilegeError as exc:
        if not check.missing or "SELECT" in check.missing:
            return str(exc)
    except ConfigurationError as exc:
        return str(exc)
    return None


def _when(value: object) -> str:
    if not isinstance(value, datetime):
        return "-"
    return value.isoformat(sep=" ", timespec="seconds")


def render_report(report: dict[str, Any]) -> str:
    """The report as text: each lock as ``pgleaderlock status --name`` shows it, then
    the schedules and their recent runs."""
    blocks = [render_one(lock) for lock in report["locks"]]
    if not report["locks"]:
        blocks.append(
            "locks     none configured: name them in PGLEADERLOCK['LOCKS'] or with --name"
        )
    ledger = report["ledger"]
    lines = [f"schedules ({ledger['schedules_table']}, {ledger['runs_table']})"]
    if ledger["not_read"] is not None:
        lines.append(f"          not read: {ledger['not_read']}")
    elif not ledger["schedules"]:
        lines.append("          none yet")
    for entry in ledger["schedules"]:
        outcomes = ", ".join(f"{o} {n}" for o, n in entry["outcomes"].items()) or "no runs"
        lines += [
            f"schedule  {entry['schedule']}  ({entry['spec'] or 'spec unknown'})",
            f"          next slot {_when(entry['next_slot'])}  since {_when(entry['since'])}",
            f"          runs: {outcomes}",
        ]
        for run in entry["runs"]:
            took = ""
            if isinstance(run["started_at"], datetime) and isinstance(run["finished_at"], datetime):
                seconds = (run["finished_at"] - run["started_at"]).total_seconds()
                took = f"  took {seconds:.3f}s" if math.isfinite(seconds) else ""
            detail = f"  {run['detail']}" if run["detail"] else ""
            attempt = f"  attempt {run['attempt']}" if run["attempt"] != 1 else ""
            lines.append(
                f"          {_when(run['slot'])}  {run['outcome']:<7}  term {run['term']}"
                f"  {run['holder'] or '-'}{attempt}{took}{detail}"
            )
    blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
