"""What the sessions of one lock published: the live rows of the participants table
(`pgleaderlock.core.participants`), added to a `lock_report`."""

from __future__ import annotations

from typing import Any

import psycopg

from ..lowlevel import (
    PUBLISHED_FIELDS,
    ParticipantTable,
    first_line,
    key_to_oid,
    participants_of,
    published,
)
from .models import LockReport, ParticipantRow
from .tables import unreadable

__all__ = ["add_participants"]


def add_participants(
    conn: psycopg.Connection[Any], report: LockReport, table: ParticipantTable
) -> None:
    """The live rows of the participants table for the lock (see
    `pgleaderlock.core.participants`): each session's identity, priority and metadata,
    and the observers (``eligible`` false). A row counts only while its session (pid and
    ``backend_start``, of the writer's role) is alive; the table is read only if a
    trusted role owns it and its schema (and its row-level security is the library's).
    Rows of roles that are not trusted are listed, marked ``"trusted": false``, and
    never describe a holder or a waiting session."""
    report["participants_table"] = {"table": table.shown, "not_read": None}
    report["participants"], report["observers"] = [], []
    for s in report["holders"] + report["waiting"]:
        s["identity"], s["priority"], s["metadata"] = None, None, None
    try:
        with conn.transaction():  # a savepoint: an error here spares the report's transaction
            _read_participants(conn, report, table)
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        report["participants_table"]["not_read"] = first_line(exc)


def _read_participants(
    conn: psycopg.Connection[Any], report: LockReport, table: ParticipantTable
) -> None:
    # The library's templates number their values {0}, {1}...: named here, as a value
    # may come before another in the text.
    placeholders = [f"%(p{i})s" for i in range(6)]

    def named(*given: object) -> dict[str, object]:
        return {f"p{i}": value for i, value in enumerate(given)}

    reason = unreadable(conn, table)
    if reason is not None:
        report["participants_table"]["not_read"] = reason
        return
    keys = (report["lock"]["key1"], report["lock"]["key2"])
    rows = conn.execute(
        participants_of(table).format(*placeholders).encode(),
        named(key_to_oid(keys[0]), key_to_oid(keys[1]), *keys, list(table.trusted_roles), True),
    ).fetchall()
    by_pid: dict[int, ParticipantRow] = {}
    for values in rows:
        pid, application_name, usename, trusted = values[:4]
        found = published(values[4 : 4 + PUBLISHED_FIELDS])
        if found.identity is None:
            continue  # not to be read (see ``problems``)
        eligible, leading, waiting = values[4 + PUBLISHED_FIELDS :]
        entry: ParticipantRow = {
            "pid": pid, "application_name": application_name, "usename": usename,
            "identity": found.identity, "name": found.name, "priority": found.priority,
            "metadata": found.metadata, "since": found.since, "term": found.term,
            "eligible": eligible, "leading": leading, "waiting": waiting,
            "trusted": bool(trusted), "skipped": list(found.problems),
        }  # fmt: skip
        report["participants"].append(entry)
        if not trusted:
            continue
        if not entry["eligible"]:
            report["observers"].append(entry)
        elif entry["leading"] or entry["pid"] not in by_pid:
            by_pid[entry["pid"]] = entry
    for s in report["holders"] + report["waiting"]:
        found_entry = by_pid.get(s["pid"])
        if found_entry is not None:
            s["identity"] = found_entry["identity"]
            s["priority"] = found_entry["priority"]
            s["metadata"] = found_entry["metadata"]
