"""``pgleaderlock status``: who holds the lock now, and who waits for it; with
``--group``, who leads what in a [`Coordinator`][pgleaderlock.Coordinator]'s group.

One short psycopg (sync) connection reads ``pg_locks`` joined with
``pg_stat_activity``, under a statement timeout. The queries and the reports they build
(plain dicts, also the ``--json`` output) are here; the text layout is in
`pgleaderlock.cli.render`.

A coordinator's sessions are named ``pgl:<group>:<member>:<role>``
(`pgleaderlock.coordination.protocol`): every report says which group member a session
belongs to, and ``--group`` reads the whole group from the server alone, as the members
themselves do.

Any role may name its sessions so. Every session's role (``usename``) is shown, and
whether it is trusted: the role ``status`` runs as, a superuser, or a ``--trusted-role``,
as a member trusts its own role and its ``trusted_roles``. A session that claims to be
pgleaderlock's (by its ``application_name``) but is of another role is marked
(``"impostor": true``) and never counted as a member.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import click
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from ..backends.sql import TABLE_CHECK, trusted_roles_sql
from ..coordination.protocol import check_group, checkpoint_name, member_key, name_keys, prefix
from ..coordination.workers import CheckpointTable
from ..core.config import SAFE_SETTINGS, check_roles
from ..core.errors import ConfigurationError
from ..core.keys import find_slot, key_to_oid, lock_keys, oid_to_key
from ..core.leader import PUBLISHED_FIELDS, ParticipantTable, published
from ..core.participants import participants_of
from ..core.registry import without_driver
from ..core.tables import LibraryTable, TableCheck
from ..schedule.ledger import RunTable, ScheduleTable
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
from .render import json_default, render_all, render_group, render_one

__all__ = ["Reader", "schedule_report", "status", "unreadable"]

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

_APP_NAME = re.compile(r"^pgleaderlock:(?P<label>.*)@[^@]*$")
_GROUP_APP_NAME = re.compile(
    r"^pgl:(?P<group>[A-Za-z0-9_.-]{1,32}):(?P<member>[^:]+):(?P<role>[a-z]+)$"
)
"""A coordinator's session (see `pgleaderlock.coordination.protocol.app_name`)."""
_NAME_ROLES = ("hold", "lock")
"""The roles of the sessions that hold a member's names (shared, dedicated)."""

_CURRENT_DATABASE = (
    "(SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())"
)
_TRUSTED = f"\nWITH trusted AS ({trusted_roles_sql('%(trusted_roles)s')})"
"""The roles whose sessions are trusted: this one's, superusers, ``--trusted-role``."""
_IS_TRUSTED = "COALESCE(a.usesysid IN (SELECT oid FROM trusted), false)"
_SESSION_COLUMNS = f"""
    l.pid, l.granted, l.mode, a.application_name, host(a.client_addr) AS client_addr,
    a.client_port, a.usename, a.backend_start, a.state_change, a.state, {{waitstart}},
    {_IS_TRUSTED}
"""
_ONE_LOCK = f"""{_TRUSTED}
SELECT {_SESSION_COLUMNS}
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 2
  AND l.database = {_CURRENT_DATABASE}
  AND l.classid = %(classid)s::int8::oid AND l.objid = %(objid)s::int8::oid
ORDER BY l.granted DESC, 11 NULLS LAST, l.pid
"""
_ALL_LOCKS = f"""{_TRUSTED}
SELECT l.classid::int8, l.objid::int8, l.objsubid::int4, {_SESSION_COLUMNS}
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = {_CURRENT_DATABASE}
"""
_GROUP = f"""{_TRUSTED}
SELECT l.classid::int8, l.objid::int8, {_SESSION_COLUMNS}
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.database = {_CURRENT_DATABASE}
UNION ALL
SELECT NULL, NULL, a.pid, NULL, NULL, a.application_name, host(a.client_addr), a.client_port,
       a.usename, a.backend_start, a.state_change, a.state, NULL, {_IS_TRUSTED}
FROM pg_catalog.pg_stat_activity a
WHERE pg_catalog.starts_with(a.application_name, %(prefix)s)
  AND a.datname = pg_catalog.current_database()
"""
_SESSION_FIELDS = (
    "pid",
    "granted",
    "mode",
    "application_name",
    "client_addr",
    "client_port",
    "usename",
    "backend_start",
    "state_change",
    "state",
    "wait_start",
    "trusted",
)


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

    def build(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        try:
            info = _server_info(conn, trusted_roles)
            if group is not None:
                found, skipped = _checkpoint_names(conn, table, group)
                report = _group(conn, info, group, {**found, **names})
                report["checkpoint_table"] = {"table": table.shown, "not_read": skipped}
            elif target is not None:
                report = _one_lock(conn, info, target)
                _add_participants(conn, report, participants, target)
                if target.name is not None:
                    report["schedules"] = schedule_report(
                        conn, *ledger, [f"{target.name}:"], last_runs
                    )
            else:
                report = _all_locks(conn, info)
        except psycopg.errors.QueryCanceled:
            raise CliError(f"the status query took longer than {timeout:g} s") from None
        except psycopg.Error as exc:
            raise CliError(f"status query failed: {first_line(exc)}") from None
        return report

    def text(report: dict[str, Any]) -> str:
        if group is not None:
            return render_group(report)
        if target is None:
            return render_all(report)
        return render_one(report)

    if watch:
        if as_json:
            raise CliError("--watch draws on the terminal: leave out --json")
        from .watch import watch_status  # needs the tui extra (rich)

        def build_bounded(conn: psycopg.Connection[Any]) -> dict[str, Any]:
            with bounded(conn, timeout):
                return build(conn)

        with Reader(lambda: _open(dsn, timeout), build_bounded) as reader:
            return watch_status(reader, text, positive("--interval", interval))
    with _connect(dsn, timeout) as conn:
        report = build(conn)
    click.echo(json.dumps(report, indent=2, default=json_default) if as_json else text(report))
    return EXIT_OK


class Reader:
    """A status report on demand, for ``--watch``: one connection kept between reports,
    opened again after an error (each report bounded as for ``status``)."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        build: Callable[[psycopg.Connection[Any]], dict[str, Any]],
    ) -> None:
        self._connect = connect
        self._build = build
        self._conn: psycopg.Connection[Any] | None = None

    def __call__(self) -> dict[str, Any]:
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


@contextlib.contextmanager
def _connect(dsn: str, timeout_s: float) -> Iterator[psycopg.Connection[Any]]:
    """A short connection whose statements run in one transaction, bounded as
    `bounded` says."""
    with _open(dsn, timeout_s) as conn, bounded(conn, timeout_s):
        yield conn


def _open(dsn: str, timeout_s: float) -> psycopg.Connection[Any]:
    """An autocommit connection (status always connects with psycopg). It sets nothing
    at startup: a pooler refuses startup options (PgBouncer: ``unsupported startup
    parameter: options``); `bounded` sets what a report needs, for its transaction."""
    driver_dsn = without_driver(dsn)
    try:
        conninfo_to_dict(driver_dsn)
    except psycopg.Error as exc:
        raise CliError(f"malformed DSN {dsn!r}: {first_line(exc)}") from None
    try:
        return psycopg.connect(
            driver_dsn,
            autocommit=True,
            connect_timeout=max(2, math.ceil(timeout_s)),
            application_name="pgleaderlock-status",
        )
    except psycopg.Error as exc:
        raise CliError(f"cannot connect to the database: {first_line(exc)}; DSN: {dsn}") from None


_BOUNDS = (
    "SELECT pg_catalog.set_config('statement_timeout', %s, true),"
    " pg_catalog.set_config('search_path', %s, true)"
)


@contextlib.contextmanager
def bounded(conn: psycopg.Connection[Any], timeout_s: float) -> Iterator[None]:
    """One transaction whose statements time out after ``timeout_s`` and never resolve
    a name through a schema another role may write to (the library's own sessions'
    ``search_path``; the queries rely on it). Both are transaction-local, so they reach
    no other client through a pooler, and a report reads one snapshot."""
    search_path = SAFE_SETTINGS["search_path"]
    with conn.transaction():
        conn.execute(_BOUNDS, (str(math.ceil(timeout_s * 1000)), search_path))
        yield


@dataclass(frozen=True)
class _ServerInfo:
    now: datetime
    database: str
    version: int
    user: str
    trusted_roles: tuple[str, ...]

    @property
    def params(self) -> dict[str, Any]:
        return {"trusted_roles": list(self.trusted_roles)}

    @property
    def trust(self) -> dict[str, Any]:
        """Whose sessions the report trusts (besides superusers)."""
        return {"user": self.user, "trusted_roles": list(self.trusted_roles)}


def _server_info(conn: psycopg.Connection[Any], trusted_roles: tuple[str, ...]) -> _ServerInfo:
    row = conn.execute(
        "SELECT pg_catalog.now(), pg_catalog.current_database(),"
        " pg_catalog.current_setting('server_version_num')::int, current_user::text"
    ).fetchone()
    assert row is not None
    return _ServerInfo(row[0], row[1], row[2], row[3], trusted_roles)


def _waitstart(info: _ServerInfo) -> str:
    # pg_locks.waitstart exists since PostgreSQL 14.
    return "l.waitstart" if info.version >= 140000 else "NULL::timestamptz AS waitstart"


def _session(row: Sequence[Any], now: datetime) -> dict[str, Any]:
    session = dict(zip(_SESSION_FIELDS, row, strict=True))
    for field in ("backend_start", "state_change", "wait_start"):
        value = session[field]
        session[f"{field}_age_s"] = (
            round((now - value).total_seconds(), 3) if isinstance(value, datetime) else None
        )
    application_name = session["application_name"] or ""
    match = _GROUP_APP_NAME.match(application_name)
    session["group"], session["member"], session["role"] = (
        match.group("group", "member", "role") if match and session["trusted"] else (None,) * 3
    )
    claims = match is not None or _APP_NAME.match(application_name) is not None
    session["impostor"] = claims and not session["trusted"]
    return session


def _one_lock(conn: psycopg.Connection[Any], info: _ServerInfo, target: Target) -> dict[str, Any]:
    query = _ONE_LOCK.format(waitstart=_waitstart(info))
    rows = conn.execute(
        query.encode(),
        {"classid": key_to_oid(target.key1), "objid": key_to_oid(target.key2), **info.params},
    ).fetchall()
    sessions = [_session(row, info.now) for row in rows]
    holders = [s for s in sessions if s["granted"]]
    waiting = [s for s in sessions if not s["granted"]]
    return {
        "lock": {"name": target.name, "key1": target.key1, "key2": target.key2},
        "database": info.database,
        "checked_at": info.now,
        "held": bool(holders),
        "holders": holders,
        "waiting_count": len(waiting),
        "waiting": waiting,
        "trust": info.trust,
    }


def _add_participants(
    conn: psycopg.Connection[Any], report: dict[str, Any], table: ParticipantTable, target: Target
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
        s.update(identity=None, priority=None, metadata=None)
    try:
        with conn.transaction():  # a savepoint: an error here spares the report's transaction
            _read_participants(conn, report, table, target)
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        report["participants_table"]["not_read"] = first_line(exc)


def _read_participants(
    conn: psycopg.Connection[Any], report: dict[str, Any], table: ParticipantTable, target: Target
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
    keys = (target.key1, target.key2)
    rows = conn.execute(
        participants_of(table).format(*placeholders).encode(),
        named(key_to_oid(keys[0]), key_to_oid(keys[1]), *keys, list(table.trusted_roles), True),
    ).fetchall()
    by_pid: dict[int, dict[str, Any]] = {}
    for values in rows:
        pid, application_name, usename, trusted = values[:4]
        found = published(values[4 : 4 + PUBLISHED_FIELDS])
        if found.identity is None:
            continue  # not to be read (see ``problems``)
        eligible, leading, waiting = values[4 + PUBLISHED_FIELDS :]
        entry = {
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
            s.update(
                identity=found_entry["identity"],
                priority=found_entry["priority"],
                metadata=found_entry["metadata"],
            )


def _name_for(keys: tuple[int, int], application_name: str | None) -> str | None:
    """The lock name, when the holder is a pgleaderlock session whose name gives these
    keys, or a coordinator's session holding its member lock."""
    match = _APP_NAME.match(application_name or "")
    if match is not None:
        label = match.group("label")
    else:
        member = _GROUP_APP_NAME.match(application_name or "")
        if member is None:
            return None
        label = f"pgleaderlock-member:{member.group('group')}:{member.group('member')}"
    try:
        if label and lock_keys(label) == keys:
            return label
    except ConfigurationError:  # pragma: no cover - label is a non-empty str
        return None
    if match is None or _KEYS_LABEL.match(label):
        return None
    slot = _slot_of(label, keys)  # a Semaphore's slot, named by the semaphore's name
    return None if slot is None else f"{label}[slot {slot}]"


_KEYS_LABEL = re.compile(r"^-?\d+,-?\d+$")
"""The label of a lock made from keys (``key1,key2``): no semaphore's name."""


@functools.lru_cache(maxsize=4096)
def _slot_of(label: str, keys: tuple[int, int]) -> int | None:
    return find_slot(label, keys, limit=256)


def _all_locks(conn: psycopg.Connection[Any], info: _ServerInfo) -> dict[str, Any]:
    query = _ALL_LOCKS.format(waitstart=_waitstart(info))
    locks = []
    for classid, objid, objsubid, *session_row in conn.execute(
        query.encode(), info.params
    ).fetchall():
        session = _session(session_row, info.now)
        if objsubid == 2:
            keys = (oid_to_key(classid), oid_to_key(objid))
            lock: dict[str, Any] = {
                "kind": "int4 pair",
                "key1": keys[0],
                "key2": keys[1],
                "name": _name_for(keys, session["application_name"]),
            }
        else:  # pg_advisory_lock(bigint): high and low halves
            key = (classid << 32) | objid
            lock = {"kind": "bigint", "key": key - 2**64 if key > 2**63 - 1 else key}
        locks.append({**lock, **session})
    locks.sort(
        key=lambda lk: (
            lk["kind"] != "bigint",
            (lk.get("key", 0), lk.get("key1", 0), lk.get("key2", 0)),
            not lk["granted"],
            lk["pid"],
        )
    )
    return {"database": info.database, "checked_at": info.now, "locks": locks, "trust": info.trust}


# ---------------------------------------------------------------------- --group

Key = tuple[int, int]


def unreadable(conn: psycopg.Connection[Any], table: LibraryTable) -> str | None:
    """Why one of the library's tables is not to be read (``None``: it may be). It is
    read only if it is a plain table that a trusted role owns, in a schema a trusted
    role owns: another role's table, or a view, could run that role's code as yours."""
    return _unreadable(conn, table)[0]


def _unreadable(conn: psycopg.Connection[Any], table: LibraryTable) -> tuple[str | None, bool]:
    """`unreadable`'s reason, and whether it is that the table (or schema) is absent."""
    values = {"v0": table.schema, "v1": table.name, "v2": list(table.trusted_roles)}
    row = conn.execute(TABLE_CHECK.sql("%(v0)s", "%(v1)s", "%(v2)s"), values).fetchone()
    assert row is not None
    check = TableCheck.of(table, row)
    return check.unreadable(), check.schema_owner is None or check.relkind is None


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
) -> dict[str, Any]:
    """The schedules in the ledger whose names start with one of ``prefixes`` (all
    when empty): spec, next slot, the outcomes of the rows kept, and the last ``last``
    runs. The tables are read only if they may be trusted (see `unreadable`); else
    ``not_read`` says why. Tables that do not exist (no schedule ran yet) are no error:
    no items, and ``absent`` says which."""
    report: dict[str, Any] = {
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
    report: dict[str, Any],
) -> dict[str, Any]:
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
                    dict(zip(_RUN_FIELDS, row, strict=True)) for row in recent.fetchall()
                ],
            }
        )
    return report


def _checkpoint_names(
    conn: psycopg.Connection[Any], table: CheckpointTable, group: str
) -> tuple[dict[Key, str], str | None]:
    """The group's names in the checkpoint table (its rows ``<group>:<name>``), by their
    keys, and why the table was not read (``None``: it was). It is read only if it is a
    plain table that a trusted role owns, in a schema a trusted role owns: another
    role's table, or a view, could run that role's code as yours."""
    try:
        with conn.transaction():  # a savepoint: an error here spares the report's transaction
            skipped = unreadable(conn, table)
            if skipped is not None:
                return {}, skipped
            head = checkpoint_name(group, "")
            query = sql.SQL(
                "SELECT subscription_name FROM {}.{}"
                " WHERE pg_catalog.starts_with(subscription_name, %s)"
            ).format(sql.Identifier(table.schema), sql.Identifier(table.name))
            rows = conn.execute(query, (head,)).fetchall()
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        return {}, first_line(exc)
    found = {str(n)[len(head) :] for (n,) in rows if str(n)[len(head) :]}
    return {name_keys(group, name): name for name in found}, None


def _group(
    conn: psycopg.Connection[Any],
    info: _ServerInfo,
    group: str,
    names: dict[Key, str],
) -> dict[str, Any]:
    """Who leads what in ``group``: its members (from the names of their sessions of
    trusted roles) and, for every lock one of its members holds or waits for and every
    name asked about, the holder and the waiting sessions; and the impostors: sessions
    named like the group's, of roles not trusted."""
    query = _GROUP.format(waitstart=_waitstart(info))
    rows = conn.execute(query.encode(), {"prefix": prefix(group), **info.params}).fetchall()
    members: dict[str, dict[str, Any]] = {}
    locks: list[tuple[Key, dict[str, Any]]] = []
    impostors: list[dict[str, Any]] = []
    for classid, objid, *session_row in rows:
        session = _session(session_row, info.now)
        if classid is None:
            if session["impostor"]:
                impostors.append(_brief(session))
            elif session["group"] == group:
                member = members.setdefault(session["member"], _member(session["member"]))
                member["sessions"].append(_brief(session))
        else:
            locks.append(((oid_to_key(classid), oid_to_key(objid)), session))
    member_keys = {member_key(group, m): m for m in members}
    ours = {k for k, s in locks if s["group"] == group and s["role"] in _NAME_ROLES}
    relevant = (ours | set(names)) - set(member_keys)
    leaders: dict[Key, dict[str, Any]] = {
        key: {"name": names.get(key), "key1": key[0], "key2": key[1], "member": None,
              "pid": None, "role": None, "application_name": None, "usename": None,
              "impostor": False, "waiting": []}
        for key in relevant
    }  # fmt: skip
    for key, session in locks:
        mine = session["group"] == group
        if key in member_keys:  # a member's own lock, or a watcher's wait for it
            if mine and session["role"] == "watch" and not session["granted"]:
                watcher = members.get(session["member"])
                if watcher is not None:
                    watcher["watching"] = member_keys[key]
            continue
        entry = leaders.get(key)
        if entry is None:
            continue
        if entry["name"] is None:
            entry["name"] = _name_for(key, session["application_name"])
        who = session["member"] if mine else ""
        if session["granted"]:
            entry.update(member=who, pid=session["pid"], role=session["role"],
                         application_name=session["application_name"],
                         usename=session["usename"], impostor=session["impostor"])  # fmt: skip
            if mine and who in members and session["role"] in _NAME_ROLES:
                members[who]["names"] += 1
        else:
            entry["waiting"].append(
                {"member": who, "pid": session["pid"], "role": session["role"],
                 "application_name": session["application_name"],
                 "usename": session["usename"], "impostor": session["impostor"],
                 "wait_start_age_s": session["wait_start_age_s"]}
            )  # fmt: skip
    for entry in leaders.values():
        entry["waiting"].sort(key=lambda w: (w["member"] or "~", w["pid"]))
    for member in members.values():
        member["mode"] = _mode({s["role"] for s in member["sessions"]})
        member["sessions"].sort(key=lambda s: (_ROLE_ORDER.get(s["role"], 9), s["pid"]))
    return {
        "group": group,
        "database": info.database,
        "checked_at": info.now,
        "trust": info.trust,
        "members": [members[m] for m in sorted(members)],
        "leaders": sorted(
            leaders.values(),
            key=lambda e: (e["name"] is None, e["name"] or "", e["key1"], e["key2"]),
        ),
        "impostors": sorted(impostors, key=lambda s: s["pid"]),
    }


_ROLE_ORDER = {"hold": 0, "lock": 0, "watch": 1, "util": 1, "listen": 2}


def _member(member: str) -> dict[str, Any]:
    return {"member": member, "mode": None, "names": 0, "sessions": [], "watching": None}


def _brief(session: dict[str, Any]) -> dict[str, Any]:
    """A member's session, without the lock fields."""
    keep = ("pid", "role", "application_name", "client_addr", "client_port", "usename",
            "backend_start", "backend_start_age_s", "state", "impostor")  # fmt: skip
    return {k: session[k] for k in keep}


def _mode(roles: set[str]) -> str | None:
    """The member's session mode, from its sessions' roles."""
    if "hold" in roles:
        return "shared"
    if roles & {"lock", "util"}:
        return "dedicated"
    return "shared" if "watch" in roles else None  # (both modes have a watch session)
