"""Who leads what in a [`Coordinator`][pgleaderlock.Coordinator]'s group, read from the
server alone, as the members themselves do.

A coordinator's sessions are named ``pgl:<group>:<member>:<role>``
(`pgleaderlock.coordination.protocol`): the group's members are the sessions so named
of trusted roles; the names come from the caller, the checkpoint table's rows
(`checkpoint_names`) and plain pgleaderlock locks. A session of another role that is
named so is an impostor, listed and never counted as a member.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import psycopg
from psycopg import sql

from ..coordination.protocol import checkpoint_name, member_key, name_keys, prefix
from ..coordination.workers import CheckpointTable
from ..lowlevel import first_line, oid_to_key
from .connection import ServerInfo
from .models import GroupReport, Member, MemberSession, NameLeader, Session
from .sessions import (
    _CURRENT_DATABASE,
    _IS_TRUSTED,
    _SESSION_COLUMNS,
    _TRUSTED,
    _session,
    _waitstart,
    name_for,
)
from .tables import unreadable

__all__ = ["Key", "checkpoint_names", "group_report"]

Key = tuple[int, int]
"""A lock's ``(key1, key2)``."""

_NAME_ROLES = ("hold", "lock")
"""The roles of the sessions that hold a member's names (shared, dedicated)."""

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


def checkpoint_names(
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


def group_report(
    conn: psycopg.Connection[Any],
    info: ServerInfo,
    group: str,
    names: Mapping[Key, str],
) -> GroupReport:
    """Who leads what in ``group``: its members (from the names of their sessions of
    trusted roles) and, for every lock one of its members holds or waits for and every
    name asked about, the holder and the waiting sessions; and the impostors: sessions
    named like the group's, of roles not trusted."""
    query = _GROUP.format(waitstart=_waitstart(info))
    rows = conn.execute(query.encode(), {"prefix": prefix(group), **info.params}).fetchall()
    members: dict[str, Member] = {}
    locks: list[tuple[Key, Session]] = []
    impostors: list[MemberSession] = []
    for classid, objid, *session_row in rows:
        session = _session(session_row, info.now)
        if classid is None:
            if session["impostor"]:
                impostors.append(_brief(session))
            elif session["group"] == group and session["member"] is not None:
                member = members.setdefault(session["member"], _member(session["member"]))
                member["sessions"].append(_brief(session))
        else:
            locks.append(((oid_to_key(classid), oid_to_key(objid)), session))
    member_keys = {member_key(group, m): m for m in members}
    ours = {k for k, s in locks if s["group"] == group and s["role"] in _NAME_ROLES}
    relevant = (ours | set(names)) - set(member_keys)
    leaders: dict[Key, NameLeader] = {
        key: {"name": names.get(key), "key1": key[0], "key2": key[1], "member": None,
              "pid": None, "role": None, "application_name": None, "usename": None,
              "impostor": False, "waiting": []}
        for key in relevant
    }  # fmt: skip
    for key, session in locks:
        mine = session["group"] == group
        if key in member_keys:  # a member's own lock, or a watcher's wait for it
            if mine and session["role"] == "watch" and not session["granted"]:
                watcher = members.get(session["member"] or "")
                if watcher is not None:
                    watcher["watching"] = member_keys[key]
            continue
        entry = leaders.get(key)
        if entry is None:
            continue
        if entry["name"] is None:
            entry["name"] = name_for(key, session["application_name"])
        who = session["member"] if mine else ""
        if session["granted"]:
            entry["member"], entry["pid"], entry["role"] = who, session["pid"], session["role"]
            entry["application_name"] = session["application_name"]
            entry["usename"], entry["impostor"] = session["usename"], session["impostor"]
            if mine and who is not None and who in members and session["role"] in _NAME_ROLES:
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
        member["mode"] = _mode({s["role"] for s in member["sessions"] if s["role"] is not None})
        member["sessions"].sort(key=lambda s: (_ROLE_ORDER.get(s["role"] or "", 9), s["pid"]))
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


def _member(member: str) -> Member:
    return {"member": member, "mode": None, "names": 0, "sessions": [], "watching": None}


def _brief(session: Session) -> MemberSession:
    """A member's session, without the lock fields."""
    keep = ("pid", "role", "application_name", "client_addr", "client_port", "usename",
            "backend_start", "backend_start_age_s", "state", "impostor")  # fmt: skip
    fields: dict[str, Any] = dict(session)
    return cast(MemberSession, {k: fields[k] for k in keep})


def _mode(roles: set[str]) -> str | None:
    """The member's session mode, from its sessions' roles."""
    if "hold" in roles:
        return "shared"
    if roles & {"lock", "util"}:
        return "dedicated"
    return "shared" if "watch" in roles else None  # (both modes have a watch session)
