"""The schedule ledger (`pgleaderlock.schedule`) as a report: each schedule's spec,
next slot, outcomes and last runs, read from the tables a
[`Scheduler`][pgleaderlock.schedule.Scheduler], ``pgleaderlock cron`` or Celery beat
write, only if they may be trusted (`pgleaderlock.status.tables.unreadable`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import psycopg

from ..lowlevel import first_line
from ..schedule.ledger import RunTable, ScheduleTable
from .models import Run, ScheduleReport
from .tables import _unreadable

__all__ = ["schedule_report"]

_SCHEDULES = (
    "SELECT s.schedule, s.spec, s.since, s.next_slot, s.updated_at,"
    " (SELECT coalesce(pg_catalog.json_object_agg(outcome, n), '{{}}') FROM"
    "  (SELECT outcome, count(*) AS n FROM {runs} r WHERE r.schedule = s.schedule"
    "   GROUP BY outcome) c)"
    " FROM {schedules} s ORDER BY s.schedule"
)
_LAST_RUNS = (
    "SELECT slot, term, holder, outcome, attempt, started_at, finished_at, detail"
    " FROM {runs} WHERE schedule = %s ORDER BY slot DESC LIMIT %s"
)
_RUN_FIELDS = (
    "slot", "term", "holder", "outcome", "attempt", "started_at", "finished_at", "detail"
)  # fmt: skip


def schedule_report(
    conn: psycopg.Connection[Any],
    runs: RunTable,
    schedules: ScheduleTable,
    prefixes: Sequence[str] = (),
    last: int = 5,
) -> ScheduleReport:
    """The schedules in the ledger whose names start with one of ``prefixes`` (all
    when empty): spec, next slot, the outcomes of the rows kept, and the last ``last``
    runs. The tables are read only if they may be trusted (see `unreadable`); else
    ``not_read`` says why. Tables that do not exist (no schedule ran yet) are no error:
    no items, and ``absent`` says which."""
    report: ScheduleReport = {
        "table": schedules.shown,
        "runs_table": runs.shown,
        "not_read": None,
        "absent": None,
        "items": [],
    }
    try:
        with conn.transaction():  # a savepoint: an error here spares the report's transaction
            return _schedules(conn, runs, schedules, prefixes, last, report)
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        report["not_read"] = first_line(exc)
    return report


def _schedules(
    conn: psycopg.Connection[Any],
    runs: RunTable,
    schedules: ScheduleTable,
    prefixes: Sequence[str],
    last: int,
    report: ScheduleReport,
) -> ScheduleReport:
    for table in (schedules, runs):
        skipped, absent = _unreadable(conn, table)
        if skipped is not None:
            # An absent table is no error: no schedule ran yet.
            report["absent" if absent else "not_read"] = skipped
            return report
    names = {"runs": runs.sql, "schedules": schedules.sql}
    for schedule, spec, since, next_slot, updated_at, outcomes in conn.execute(
        _SCHEDULES.format(**names).encode()
    ).fetchall():
        head = next((p for p in prefixes if str(schedule).startswith(p)), None)
        if prefixes and head is None:
            continue
        recent = conn.execute(_LAST_RUNS.format(**names).encode(), (schedule, last))
        report["items"].append(
            {
                "schedule": schedule,
                "job": str(schedule)[len(head or "") :],
                "spec": spec,
                "since": since,
                "next_slot": next_slot,
                "updated_at": updated_at,
                "outcomes": outcomes,
                "last_runs": [
                    cast(Run, dict(zip(_RUN_FIELDS, row, strict=True))) for row in recent.fetchall()
                ],
            }
        )
    return report
