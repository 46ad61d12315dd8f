"""``manage.py pgleaderlock_status``: the leaders of the configured locks, and the
schedules in the ledger (their spec, next slot, recent runs and outcomes).

The locks' part is ``pgleaderlock status --name``'s (the read model
`pgleaderlock.status` and its text layout, `pgleaderlock.status.render`; neither needs
the command line's libraries): holder, waiting sessions, and whether their roles are
trusted. The ledger's part reads the tables a
`pgleaderlock.schedule.Scheduler` writes, only if they exist and can be
trusted (a plain table, owned by a trusted role, in a schema a trusted role owns:
another role's table or view could run that role's code as yours); otherwise it says
why they were not read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypedDict

from ...lowlevel import check_roles, lock_keys, printable_tree
from ...status import LockReport, ScheduleReport, connect, lock_report, schedule_report, server_info
from ...status.render import render_one, schedule_lines
from .conf import Settings, build_dsn

__all__ = ["Report", "build_report", "render_report"]


class Report(TypedDict):
    """``manage.py pgleaderlock_status``'s report (also its ``--json``): the configured
    locks ([`LockReport`][pgleaderlock.status.LockReport]) and the schedule ledger
    ([`ScheduleReport`][pgleaderlock.status.ScheduleReport])."""

    database: str
    checked_at: datetime
    locks: list[LockReport]
    ledger: ScheduleReport
    schedules_shown: list[str] | None
    """The name prefixes of the schedules shown (``LOCK:``), ``None`` for all."""


def build_report(
    settings: Settings,
    names: Sequence[str],
    *,
    runs: int = 5,
    timeout_s: float = 5.0,
    schedules: Sequence[str] = (),
    all_schedules: bool = False,
) -> Report:
    """The report: ``{"database", "checked_at", "locks": [...], "ledger": {...},
    "schedules_shown": [...]}``.

    Args:
        settings: the app's settings (the database, trusted roles, the ledger's tables).
        names: the locks to show.
        runs: how many of each schedule's newest runs to show.
        timeout_s: the connect timeout and the statement timeout.
        schedules: show only the schedules whose names start with one of these (a
            schedule is named ``<lock>:<job>``); when empty, the schedules of the
            locks shown (``names``): the ledger may hold other applications' too.
        all_schedules: show every schedule in the ledger.

    Raises:
        ConnectionError: the database cannot be reached (the message is one line, its
            password masked).
        psycopg.Error: a query failed (``QueryCanceled``: it took longer than
            ``timeout_s``).
        ConfigurationError: a bad lock name or trusted role.
    """
    trusted = check_roles(tuple(settings.options.get("trusted_roles", ())))  # before I/O
    keys = [(name, lock_keys(name)) for name in names]
    shown = None if all_schedules else list(schedules or [f"{name}:" for name in names])
    tables = settings.ledger_tables()
    with connect(build_dsn(settings.database), timeout_s) as conn:
        info = server_info(conn, trusted)
        if shown == []:  # no lock named: none of the ledger's schedules is this project's
            ledger: ScheduleReport = {"table": tables[1].shown, "runs_table": tables[0].shown,
                                      "not_read": None, "absent": None, "items": []}  # fmt: skip
        else:
            ledger = schedule_report(conn, *tables, shown or (), runs)
        return {
            "database": info.database,
            "checked_at": info.now,
            "locks": [lock_report(conn, info, name, key) for name, key in keys],
            "ledger": ledger,
            "schedules_shown": shown,
        }


def render_report(report: Mapping[str, Any]) -> str:
    """The report as text: each lock as ``pgleaderlock status --name`` shows it, then
    the schedules and their recent runs. Every string another role may have written
    is shown escaped (`pgleaderlock.core.text.printable_tree`)."""
    report = printable_tree(report)
    blocks = [render_one(lock) for lock in report["locks"]]
    if not report["locks"]:
        blocks.append(
            "locks     none configured: name them in PGLEADERLOCK['LOCKS'] or with --name"
        )
    ledger = report["ledger"]
    lines = [f"schedules ({ledger['table']}, {ledger['runs_table']})"]
    if report.get("schedules_shown") == []:
        lines.append(
            "          none shown: name this project's locks in PGLEADERLOCK['LOCKS'] or "
            "with --name (their schedules are shown), or pass --all-schedules"
        )
    elif ledger["not_read"] is None and not ledger["items"]:
        absent = ledger["absent"]
        lines.append("          none yet" + (f" ({absent})" if absent else ""))
    lines += schedule_lines(ledger, report["checked_at"])
    blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
