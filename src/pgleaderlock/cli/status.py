"""``pgleaderlock status``: who holds the lock now, and who waits for it.

One short psycopg (sync) connection reads ``pg_locks`` joined with
``pg_stat_activity``, under a statement timeout. The queries and the reports they build
(plain dicts, also the ``--json`` output) are here; the text layout is in
`pgleaderlock.cli.render`.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..core.errors import ConfigurationError
from ..core.keys import key_to_oid, lock_keys, oid_to_key
from ..core.registry import without_driver
from .exits import EXIT_OK, CliError, first_line
from .options import (
    Target,
    log_options,
    positive,
    resolve_dsn,
    resolve_target,
    seconds_option,
    target_options,
)
from .render import json_default, render_all, render_one

__all__ = ["status"]

_STATUS_EPILOG = """\b
Examples:
  pgleaderlock status --name billing-scheduler
  pgleaderlock status --key1 1234 --key2 5678 --json | jq .holders[0].pid
  pgleaderlock status --all

Informational: it shows what pg_locks says at this instant. Only followers that wait
on the server (--follower-mode wait, the default) are counted as waiting; polling
followers hold no row in pg_locks between attempts.
"""

_APP_NAME = re.compile(r"^pgleaderlock:(?P<label>.*)@[^@]*$")

_SESSION_COLUMNS = """
    l.pid, l.granted, l.mode, a.application_name, host(a.client_addr) AS client_addr,
    a.client_port, a.usename, a.backend_start, a.state_change, a.state, {waitstart}
"""
_ONE_LOCK = f"""
SELECT {_SESSION_COLUMNS}
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_catalog.pg_database
                    WHERE datname = pg_catalog.current_database())
  AND l.classid = %(classid)s::int8::oid AND l.objid = %(objid)s::int8::oid
ORDER BY l.granted DESC, 11 NULLS LAST, l.pid
"""
_ALL_LOCKS = f"""
SELECT l.classid::int8, l.objid::int8, l.objsubid::int4, {_SESSION_COLUMNS}
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_catalog.pg_database
                    WHERE datname = pg_catalog.current_database())
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
)


@click.command("status", epilog=_STATUS_EPILOG)
@target_options
@click.option("--all", "all_locks", is_flag=True, help="List every advisory lock in the database.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
@seconds_option(
    "--timeout",
    default=5.0,
    text="Connect timeout and statement timeout.",
)
@log_options(cli="WARNING", library="WARNING")
def status(
    dsn: str | None,
    name: str | None,
    key1: int | None,
    key2: int | None,
    all_locks: bool,
    as_json: bool,
    timeout: float,
) -> int:
    """Show who holds the lock now and how many sessions wait for it.

    Reads pg_locks joined with pg_stat_activity: the holder's backend pid,
    application_name (pgleaderlock sets it to pgleaderlock:NAME@HOST:PID), client
    address, user, when its session started and when its state last changed; then the
    sessions waiting for the lock. --all lists every advisory lock held or awaited in
    the database, with two-key locks decoded back to signed key1/key2.
    """
    dsn = resolve_dsn(dsn)
    if all_locks:
        if name is not None or key1 is not None or key2 is not None:
            raise CliError("--all lists every lock: leave out --name/--key1/--key2")
        target = None
    else:
        target = resolve_target(name, key1, key2)
    timeout = positive("--timeout", timeout)
    with _connect(dsn, timeout) as conn:
        try:
            info = _server_info(conn)
            report = _one_lock(conn, info, target) if target else _all_locks(conn, info)
        except psycopg.errors.QueryCanceled:
            raise CliError(f"the status query took longer than {timeout:g} s") from None
        except psycopg.Error as exc:
            raise CliError(f"status query failed: {first_line(exc)}") from None
    if as_json:
        click.echo(json.dumps(report, indent=2, default=json_default))
    elif target is None:
        click.echo(render_all(report))
    else:
        click.echo(render_one(report))
    return EXIT_OK


@contextlib.contextmanager
def _connect(dsn: str, timeout_s: float) -> Iterator[psycopg.Connection[Any]]:
    """A short autocommit connection whose statements time out after ``timeout_s``."""
    driver_dsn = without_driver(dsn)  # status always connects with psycopg
    try:
        params = conninfo_to_dict(driver_dsn)
    except psycopg.Error as exc:
        raise CliError(f"malformed DSN {dsn!r}: {first_line(exc)}") from None
    existing = params.get("options")
    statement = f"-c statement_timeout={math.ceil(timeout_s * 1000)}"
    options = f"{existing} {statement}" if existing else statement
    try:
        conn = psycopg.connect(
            driver_dsn,
            autocommit=True,
            connect_timeout=max(2, math.ceil(timeout_s)),
            application_name="pgleaderlock-status",
            options=options,
        )
    except psycopg.Error as exc:
        raise CliError(f"cannot connect to the database: {first_line(exc)}; DSN: {dsn}") from None
    with conn:
        yield conn


@dataclass(frozen=True)
class _ServerInfo:
    now: datetime
    database: str
    version: int


def _server_info(conn: psycopg.Connection[Any]) -> _ServerInfo:
    row = conn.execute(
        "SELECT pg_catalog.now(), pg_catalog.current_database(),"
        " pg_catalog.current_setting('server_version_num')::int"
    ).fetchone()
    assert row is not None
    return _ServerInfo(now=row[0], database=row[1], version=row[2])


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
    return session


def _one_lock(conn: psycopg.Connection[Any], info: _ServerInfo, target: Target) -> dict[str, Any]:
    query = _ONE_LOCK.format(waitstart=_waitstart(info))
    rows = conn.execute(
        query.encode(),
        {"classid": key_to_oid(target.key1), "objid": key_to_oid(target.key2)},
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
    }


def _name_for(keys: tuple[int, int], application_name: str | None) -> str | None:
    """The lock name, when the holder is a pgleaderlock session whose name gives these keys."""
    match = _APP_NAME.match(application_name or "")
    if match is None:
        return None
    label = match.group("label")
    try:
        return label if label and lock_keys(label) == keys else None
    except ConfigurationError:  # pragma: no cover - label is a non-empty str
        return None


def _all_locks(conn: psycopg.Connection[Any], info: _ServerInfo) -> dict[str, Any]:
    query = _ALL_LOCKS.format(waitstart=_waitstart(info))
    locks = []
    for classid, objid, objsubid, *session_row in conn.execute(query.encode()).fetchall():
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
    return {"database": info.database, "checked_at": info.now, "locks": locks}
