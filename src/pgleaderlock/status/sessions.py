"""Sessions and their advisory locks: who holds one lock and who waits for it
(`lock_report`), every advisory lock in the database (`all_locks_report`).

One query joins ``pg_locks`` with ``pg_stat_activity``. Every session's role
(``usename``) is shown, and whether it is trusted: the reading role, a superuser, or
one of the trusted roles (`ServerInfo`), as a coordinator's member trusts its own
role and its ``trusted_roles``. A session that claims to be pgleaderlock's (by its
``application_name``: ``pgleaderlock:NAME@HOST:PID``, or a coordinator's
``pgl:GROUP:MEMBER:ROLE``) but is of another role is marked ``impostor``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

import psycopg

from ..backends.sql import trusted_roles_sql
from ..lowlevel import ConfigurationError, find_slot, key_to_oid, lock_keys, oid_to_key
from .connection import ServerInfo
from .models import AdvisoryLock, AllLocksReport, LockReport, Session

__all__ = ["all_locks_report", "lock_report", "name_for"]

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
"""The roles whose sessions are trusted: this one's, superusers, the trusted roles."""
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


def _waitstart(info: ServerInfo) -> str:
    # pg_locks.waitstart exists since PostgreSQL 14.
    return "l.waitstart" if info.version >= 140000 else "NULL::timestamptz AS waitstart"


def _session(row: Sequence[Any], now: datetime) -> Session:
    session: dict[str, Any] = dict(zip(_SESSION_FIELDS, row, strict=True))
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
    return cast(Session, session)


def lock_report(
    conn: psycopg.Connection[Any], info: ServerInfo, name: str | None, keys: tuple[int, int]
) -> LockReport:
    """Who holds the lock ``keys`` (named ``name``, or ``None``) and who waits for it,
    as ``pgleaderlock status --name`` shows it: holders first, then the waiting
    sessions, longest waiting first.

    Raises:
        psycopg.Error: the query failed (``QueryCanceled``: it took longer than the
            statement timeout).
    """
    query = _ONE_LOCK.format(waitstart=_waitstart(info))
    rows = conn.execute(
        query.encode(),
        {"classid": key_to_oid(keys[0]), "objid": key_to_oid(keys[1]), **info.params},
    ).fetchall()
    sessions = [_session(row, info.now) for row in rows]
    holders = [s for s in sessions if s["granted"]]
    waiting = [s for s in sessions if not s["granted"]]
    return {
        "lock": {"name": name, "key1": keys[0], "key2": keys[1]},
        "database": info.database,
        "checked_at": info.now,
        "held": bool(holders),
        "holders": holders,
        "waiting_count": len(waiting),
        "waiting": waiting,
        "trust": info.trust,
    }


def name_for(keys: tuple[int, int], application_name: str | None) -> str | None:
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


def all_locks_report(conn: psycopg.Connection[Any], info: ServerInfo) -> AllLocksReport:
    """Every advisory lock held or awaited in the database, as ``pgleaderlock status
    --all`` shows it: two-key locks decoded back to signed ``key1``/``key2`` (and
    named when a pgleaderlock holder's name gives those keys), bigint locks by their
    key.

    Raises:
        psycopg.Error: the query failed.
    """
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
                "name": name_for(keys, session["application_name"]),
            }
        else:  # pg_advisory_lock(bigint): high and low halves
            key = (classid << 32) | objid
            lock = {"kind": "bigint", "key": key - 2**64 if key > 2**63 - 1 else key}
        locks.append(cast(AdvisoryLock, {**lock, **session}))
    locks.sort(
        key=lambda lk: (
            lk["kind"] != "bigint",
            (lk.get("key", 0), lk.get("key1", 0), lk.get("key2", 0)),
            not lk["granted"],
            lk["pid"],
        )
    )
    return {"database": info.database, "checked_at": info.now, "locks": locks, "trust": info.trust}
