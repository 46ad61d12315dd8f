"""Text and JSON output of the status reports (`pgleaderlock.status`), as
``pgleaderlock status`` and ``manage.py pgleaderlock_status`` print them.

`render_one` lays out one lock (holder, then waiting sessions) as labelled lines;
`render_all` lays out every advisory lock as an aligned table; `render_group` a
coordinator group's members and who leads what, as two tables; `json_default` lets
``json.dumps`` write the reports' timestamps; `fingerprint` is what a report says,
without its clock fields (``status --watch`` redraws and the dashboard sends a page a
snapshot only when it changes).

Every string of a report may have been written by another role (an
``application_name``, a participant's ``identity`` and metadata, a run's ``holder``,
``outcome`` and ``detail``, a role's name): each text renderer first passes the whole
report through `pgleaderlock.core.text.printable_tree`, so that no control, bidi or
separator character reaches the terminal (each is shown escaped, ``\x1b``). The JSON
output is the report itself (JSON escapes such characters by itself).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ..lowlevel import printable_tree

__all__ = [
    "fingerprint",
    "json_default",
    "render_all",
    "render_group",
    "render_one",
    "schedule_lines",
]

_VOLATILE = frozenset({"checked_at", "state", "state_change"})


def json_default(value: object) -> str:
    """ISO 8601 for datetimes, ``str()`` for anything else ``json`` cannot write."""
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def fingerprint(report: Any) -> str:
    """What a report (or a dashboard snapshot) says, without its clock fields
    (``checked_at``, the ``*_age_s`` ages, a session's momentary ``state`` and
    ``state_change``): two reports with the same fingerprint show the same leadership
    picture."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: strip(v)
                for k, v in value.items()
                if k not in _VOLATILE and not k.endswith("_age_s")
            }
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(report), sort_keys=True, default=json_default)


def _when(value: object, age_s: float | None) -> str:
    if not isinstance(value, datetime):
        return "unknown"
    stamp = value.isoformat(sep=" ", timespec="seconds")
    return f"{stamp} ({_age(age_s)} ago)" if age_s is not None else stamp


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0, int(seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if s >= size:
            return f"{s // size}{unit} {(s % size) // sub_size}{sub}"
    return f"{s // 60}m {s % 60}s" if s >= 60 else f"{s}s"


def _client(session: dict[str, Any]) -> str:
    if session["client_addr"] is not None:
        return f"{session['client_addr']}:{session['client_port']}"
    if session["client_port"] == -1:
        return "local socket"
    return "unknown"


def _user(session: dict[str, Any]) -> str:
    """The session's role; an impostor (named like pgleaderlock's, of a role not
    trusted) says so."""
    user = session["usename"] or "unknown"
    return f"{user} (IMPOSTOR: role not trusted)" if session.get("impostor") else user


def _impostor_note(report: Mapping[str, Any]) -> list[str]:
    """Why a session is an impostor, when one is shown."""
    trust = report["trust"]
    roles = ", ".join([trust["user"], *trust["trusted_roles"], "superusers"])
    return [
        "",
        "IMPOSTOR: a session named like pgleaderlock's, of a role not trusted "
        f"(trusted: {roles}; add one with --trusted-role). It is never a member.",
    ]


def render_one(report: Mapping[str, Any]) -> str:
    """One lock: its keys, the database, the holder (or "free"), the waiting sessions."""
    report = printable_tree(report)
    lock = report["lock"]
    keys = f"key1={lock['key1']}, key2={lock['key2']}"
    lines = [
        f"lock      {lock['name']} ({keys})" if lock["name"] else f"lock      {keys}",
        f"database  {report['database']}",
    ]
    if not report["holders"]:
        lines.append("holder    none: the lock is free")
    for s in report["holders"]:
        lines.append(
            f"holder    pid {s['pid']}  {s['application_name'] or '(no application_name)'}"
        )
        if s.get("group") is not None:
            lines.append(
                f"          group {s['group']}  member {s['member']}  ({s['role']} session)"
            )
        lines += [
            f"          client {_client(s)}  user {_user(s)}  mode {s['mode']}",
            f"          session started {_when(s['backend_start'], s['backend_start_age_s'])}",
            f"          {s['state'] or 'state unknown'} since "
            f"{_when(s['state_change'], s['state_change_age_s'])}",
        ]
        lines += _published(s)
    count = report["waiting_count"]
    lines.append(f"waiting   {count} session{'' if count == 1 else 's'}")
    for s in report["waiting"]:
        since = _when(s["wait_start"], s["wait_start_age_s"])
        lines.append(
            f"          pid {s['pid']}  {s['application_name'] or '(no application_name)'}"
            f"  client {_client(s)}  user {_user(s)}  waiting since {since}"
        )
        lines += _published(s)
    lines += _observer_lines(report)
    lines += _untrusted_lines(report)
    if any(s["impostor"] for s in report["holders"] + report["waiting"]):
        lines += _impostor_note(report)
    if "schedules" in report:
        lines += schedule_lines(report["schedules"], report["checked_at"])
    return "\n".join(lines)


def _published(session: dict[str, Any]) -> list[str]:
    """What a session published in the participants table: identity, priority, metadata."""
    if session.get("identity") is None:
        return []
    parts = [f"identity {session['identity']}"]
    if session.get("priority") is not None:
        parts.append(f"priority {session['priority']}")
    metadata = session.get("metadata")
    if metadata is not None:  # JSON text already (printable_tree), or a document
        parts.append(
            "metadata "
            + (metadata if isinstance(metadata, str) else json.dumps(metadata, sort_keys=True))
        )
    return ["          " + "  ".join(parts)]


def _observer_lines(report: Mapping[str, Any]) -> list[str]:
    """The observers (``eligible=False``), if there are any (``--json`` also says why
    the participants table was not read, if it was not)."""
    observers = report.get("observers") or []
    if not observers:
        return []
    lines = [f"observers {len(observers)}"]
    for o in observers:
        lines.append(f"          {o['identity']}  pid {o['pid']}  {o['application_name'] or ''}")
    return lines


def _untrusted_lines(report: Mapping[str, Any]) -> list[str]:
    """Rows of the participants table written by roles that are not trusted: shown, and
    never followed (no priority, hand-over or metadata of theirs counts)."""
    rows = [p for p in report.get("participants") or [] if not p.get("trusted", True)]
    if not rows:
        return []
    lines = [
        f"untrusted {len(rows)} row{'' if len(rows) == 1 else 's'} of other roles (not followed)"
    ]
    for p in rows:
        priority = "" if p["priority"] is None else f"  priority {p['priority']}"
        lines.append(
            f"          {p['identity']}  pid {p['pid']}  user {p['usename'] or 'unknown'}"
            f"{priority}  untrusted"
        )
    return lines


def schedule_lines(schedules: Mapping[str, Any], now: datetime) -> list[str]:
    """Schedules in the ledger (`schedule_report`): spec, next slot, outcomes, last
    runs."""
    schedules = printable_tree(schedules)
    if schedules["not_read"] is not None:
        return [f"schedules not read: {schedules['not_read']}"]
    if not schedules["items"]:
        return []
    lines = []
    for item in schedules["items"]:
        upcoming = item["next_slot"]
        when = "not yet known"
        if isinstance(upcoming, datetime):
            stamp = upcoming.isoformat(sep=" ", timespec="seconds")
            ahead = (upcoming - now).total_seconds()
            when = (
                f"{stamp} (in {_age(ahead)})" if ahead >= 0 else f"{stamp} ({_age(-ahead)} overdue)"
            )
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(item["outcomes"].items())) or "none"
        lines += [
            f"schedule  {item['job'] or item['schedule']}  {item['spec']}",
            f"          next slot {when}",
            f"          runs kept: {outcomes}",
        ]
        for run in item["last_runs"]:
            took = ""
            if run["finished_at"] is not None and run["started_at"] is not None:
                took = f" in {(run['finished_at'] - run['started_at']).total_seconds():.3g} s"
            again = f" (attempt {run['attempt']})" if run["attempt"] > 1 else ""
            if run["outcome"] == "failed" and run["finished_at"] is None:
                again = f" (attempt {run['attempt']}, retry pending)"
            detail = f": {run['detail']}" if run["detail"] else ""
            lines.append(
                f"          {run['slot'].isoformat()}  {run['outcome']}{took}{again}"
                f"  term {run['term']}  {run['holder'] or '-'}{detail}"
            )
    return lines


def render_all(report: Mapping[str, Any]) -> str:
    """Every advisory lock of the database, one row per session, columns aligned."""
    report = printable_tree(report)
    if not report["locks"]:
        return f"no advisory locks in database {report['database']}"
    header = ("KEY1", "KEY2", "NAME", "PID", "STATUS", "APPLICATION_NAME", "USER", "CLIENT", "AGE")
    rows = [header]
    for lock in report["locks"]:
        if lock["kind"] == "bigint":
            key1, key2 = f"bigint {lock['key']}", "-"
        else:
            key1, key2 = str(lock["key1"]), str(lock["key2"])
        since = (
            _age(lock["backend_start_age_s"]) if lock["granted"] else _age(lock["wait_start_age_s"])
        )
        rows.append(
            (
                key1,
                key2,
                lock.get("name") or "-",
                str(lock["pid"]),
                "held" if lock["granted"] else "waiting",
                lock["application_name"] or "-",
                _user(lock),
                _client(lock),
                since,
            )
        )
    lines = _table(rows)
    if any(lock["impostor"] for lock in report["locks"]):
        lines += _impostor_note(report)
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _sessions(sessions: list[dict[str, Any]]) -> str:
    """``hold 123, watch 124, listen 125``; many sessions of one role as a count."""
    by_role: dict[str, list[str]] = {}
    for session in sessions:
        by_role.setdefault(session["role"], []).append(str(session["pid"]))
    return ", ".join(
        f"{role} {' '.join(pids)}" if len(pids) <= 3 else f"{role} x{len(pids)}"
        for role, pids in by_role.items()
    )


def _leader(entry: dict[str, Any]) -> str:
    if entry["member"] is None:
        return "(free)"
    return entry["member"] or ("(impostor)" if entry["impostor"] else "(outside the group)")


def _waiting(entry: dict[str, Any]) -> str:
    waiting = entry["waiting"]
    if not waiting:
        return "-"
    who = sorted({w["member"] or ("(impostor)" if w["impostor"] else "(outside)") for w in waiting})
    return f"{len(waiting)}: {', '.join(who)}"


def render_group(report: Mapping[str, Any]) -> str:
    """A coordinator group: its members (mode, how many names each leads, sessions),
    then each name's leader and waiting sessions."""
    report = printable_tree(report)
    count = len(report["members"])
    lines = [
        f"group     {report['group']}",
        f"database  {report['database']}",
        f"members   {count}",
    ]
    if report["members"]:
        rows: list[tuple[str, ...]] = [("MEMBER", "MODE", "NAMES", "USER", "SESSIONS")]
        for m in report["members"]:
            sessions = _sessions(m["sessions"])
            if m["watching"]:
                sessions += f" (watching {m['watching']})"
            users = ",".join(sorted({s["usename"] or "unknown" for s in m["sessions"]}))
            rows.append((m["member"], m["mode"] or "-", str(m["names"]), users, sessions))
        lines += ["", *_table(rows)]
    if report["leaders"]:
        rows = [("NAME", "KEY1", "KEY2", "LEADER", "PID", "USER", "WAITING")]
        for e in report["leaders"]:
            pid, user = ("-", "-") if e["pid"] is None else (str(e["pid"]), _user(e))
            rows.append(
                (e["name"] or "-", str(e["key1"]), str(e["key2"]), _leader(e), pid, user,
                 _waiting(e))
            )  # fmt: skip
        lines += ["", *_table(rows)]
    elif not count:
        lines.append(f"no member of group {report['group']} is connected")
    if report["impostors"]:
        rows = [("PID", "USER", "APPLICATION_NAME", "CLIENT")]
        for s in report["impostors"]:
            rows.append((str(s["pid"]), _user(s), s["application_name"] or "-", _client(s)))
        lines += ["", "Not members (named like the group's sessions):", *_table(rows)]
    impostor = report["impostors"] or any(
        e["impostor"] or any(w["impostor"] for w in e["waiting"]) for e in report["leaders"]
    )
    if impostor:
        lines += _impostor_note(report)
    return "\n".join(lines)
