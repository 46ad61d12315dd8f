"""The dashboard's read model: one snapshot of who leads what in the database, built from
the status read model (`pgleaderlock.status`) on one read-only connection.

A snapshot is a plain dict (its JSON is ``GET api/snapshot``):

- ``locks``: every named lock held or awaited (a pgleaderlock session's
  ``application_name`` gives the name), its holders, waiting sessions (with their
  priority), observers and the participants table's live rows, the leader's ``since``
  and ``term``, and the leadership changes the dashboard saw (`History`);
- ``semaphores``: every semaphore with a held slot, its slots' holders and followers;
- ``groups``: every Coordinator group with a member of a trusted role: its members, the
  names each leads, and whether they are balanced (within one name);
- ``schedules``: the schedule ledger, with each schedule's last runs (newest first);
- ``other_locks``: advisory locks no pgleaderlock name describes; ``impostors``: sessions
  named like pgleaderlock's, of roles not trusted.

Every string in it may have been written by another role: the page shows each with
``textContent``, never as markup. No DSN is in it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from ..coordination.protocol import name_keys
from ..coordination.workers import CheckpointTable
from ..lowlevel import ParticipantTable, TermTable, first_line, mask_dsn
from ..schedule.ledger import RunTable, ScheduleTable
from ..status import (
    AdvisoryLock,
    LockReport,
    add_participants,
    all_locks_report,
    checkpoint_names,
    group_report,
    schedule_report,
    server_info,
    unreadable,
)

__all__ = ["HISTORY_MAX", "LOCKS_MAX", "History", "Tables", "build_snapshot", "safe_error"]

LOCKS_MAX = 200
"""The most named locks a snapshot details (each costs two statements a refresh); the
rest are counted in ``locks_left_out``."""
HISTORY_MAX = 20
"""The leadership changes kept per lock."""
_HISTORY_LOCKS = 1000
"""The most locks whose history is kept (the oldest forgotten first)."""
_SLOT = re.compile(r"^(?P<name>.*)\[slot (?P<slot>\d+)\]$")
_LABEL = re.compile(r"^pgleaderlock:(?P<label>.*)@[^@]*$")
_MEMBER_LOCK = "pgleaderlock-member:"


@dataclass(frozen=True)
class Tables:
    """Where the library's tables are, and whose sessions and rows to trust."""

    schema: str = "public"
    trusted_roles: tuple[str, ...] = ()
    checkpoint_table: str = "pgleaderlock_subscriptions"
    last_runs: int = 20
    group_names: tuple[tuple[str, str], ...] = ()
    """``(group, name)``: names of Coordinator groups to show by name (a group's
    sessions show only its names' keys; the checkpoint table's rows give names too)."""

    def names_of(self, group: str) -> dict[tuple[int, int], str]:
        """The names given for ``group``, by their keys."""
        return {name_keys(g, n): n for g, n in self.group_names if g == group}

    @property
    def participants(self) -> ParticipantTable:
        return ParticipantTable(schema=self.schema, trusted_roles=self.trusted_roles)

    @property
    def ledger(self) -> tuple[RunTable, ScheduleTable]:
        return (
            RunTable(schema=self.schema, trusted_roles=self.trusted_roles),
            ScheduleTable(schema=self.schema, trusted_roles=self.trusted_roles),
        )

    @property
    def terms(self) -> TermTable:
        return TermTable(schema=self.schema, trusted_roles=self.trusted_roles)

    @property
    def checkpoints(self) -> CheckpointTable:
        return CheckpointTable(self.checkpoint_table, self.schema, self.trusted_roles)


@dataclass
class History:
    """The leadership changes the dashboard saw, per lock: who led from when (the
    server's clock of the snapshot that first showed it), with the term. Only what the
    dashboard saw since it started: a change between two refreshes that is undone
    before the next one is not seen (each new leader's ``NOTIFY`` makes a refresh, so
    that takes a leader that did not announce itself)."""

    started: datetime | None = None
    _seen: dict[str, deque[dict[str, Any]]] = field(default_factory=dict)

    def note(self, lock: str, leader: dict[str, Any] | None, at: datetime) -> list[dict[str, Any]]:
        """Record ``leader`` (``None``: nobody) of ``lock`` at ``at`` if it changed; the
        lock's changes, newest first."""
        entry = None
        if leader is not None:
            entry = {k: leader.get(k) for k in ("pid", "identity", "role", "term")}
        changes = self._seen.get(lock)
        if changes is None:
            if len(self._seen) >= _HISTORY_LOCKS:
                self._seen.pop(next(iter(self._seen)))
            changes = self._seen[lock] = deque(maxlen=HISTORY_MAX)
        last = changes[0]["leader"] if changes else _NEVER
        if last != entry:
            changes.appendleft({"at": at, "leader": entry, "first_seen": not changes})
        return list(changes)


_NEVER: Any = object()


def safe_error(exc: BaseException) -> str:
    """An error as one line for the page: no DSN (a connection error's message ends
    with it), no password."""
    text = first_line(exc) if isinstance(exc, psycopg.Error) else str(exc)
    text = text.split("; DSN:", 1)[0]
    return mask_dsn(" ".join(text.split()))[:500]


def build_snapshot(
    conn: psycopg.Connection[Any], tables: Tables, history: History
) -> dict[str, Any]:
    """The snapshot now, on ``conn`` (inside the caller's bounded, read-only
    transaction: `pgleaderlock.status.bounded`).

    Raises:
        psycopg.Error: a query failed (``QueryCanceled``: it took too long).
    """
    info = server_info(conn, tables.trusted_roles)
    if history.started is None:
        history.started = info.now
    every = all_locks_report(conn, info)["locks"]
    named, semaphores, others, groups = _sort_locks(every)
    impostors = [_brief(s) for s in every if s["impostor"]]
    locks = []
    shown = sorted(named)[:LOCKS_MAX]
    terms, terms_not_read = _terms(conn, tables.terms, [_keys_of(named[n]) for n in shown])
    for name in shown:
        report = _lock_report(info, name, named[name])
        add_participants(conn, report, tables.participants)
        leader = _leader(report, terms.get(_keys_of(named[name])))
        locks.append(_lock_view(report, leader, history.note(name, leader, info.now)))
    group_views = []
    for group in sorted(groups | {g for g, _ in tables.group_names}):
        found, skipped = checkpoint_names(conn, tables.checkpoints, group)
        in_group = group_report(conn, info, group, {**found, **tables.names_of(group)})
        group_views.append(_group_view(in_group, skipped))
    return {
        "database": info.database,
        "user": info.user,
        "trust": info.trust,
        "checked_at": info.now,
        "history_since": history.started,
        "locks": locks,
        "locks_left_out": max(0, len(named) - LOCKS_MAX),
        "terms_table": {"table": tables.terms.shown, "not_read": terms_not_read},
        "semaphores": [_semaphore_view(n, semaphores[n]) for n in sorted(semaphores)],
        "groups": group_views,
        "schedules": schedule_report(conn, *tables.ledger, (), tables.last_runs),
        "other_locks": [_brief(s) | _keys(s) for s in others],
        "impostors": impostors,
    }


def _sort_locks(
    every: Sequence[AdvisoryLock],
) -> tuple[
    dict[str, list[AdvisoryLock]],
    dict[str, list[AdvisoryLock]],
    list[AdvisoryLock],
    set[str],
]:
    """Named locks, semaphores (their slots and followers' watch locks), locks of no
    known name, and the groups with a trusted member."""
    by_keys: dict[tuple[int, int], list[AdvisoryLock]] = {}
    others: list[AdvisoryLock] = []
    groups: set[str] = set()
    for lock in every:
        if lock.get("group") is not None:
            groups.add(str(lock["group"]))
            continue
        if lock["kind"] != "int4 pair":
            others.append(lock)
            continue
        by_keys.setdefault((lock["key1"], lock["key2"]), []).append(lock)
    named: dict[str, list[AdvisoryLock]] = {}
    semaphores: dict[str, list[AdvisoryLock]] = {}
    unnamed: list[AdvisoryLock] = []
    for sessions in by_keys.values():
        name = next((s["name"] for s in sessions if s.get("name")), None)
        if name is None:
            unnamed.extend(sessions)
        elif name.startswith(_MEMBER_LOCK):
            continue  # a Coordinator member's own lock: shown with its group
        elif (slot := _SLOT.match(name)) is not None:
            for s in sessions:
                semaphores.setdefault(slot.group("name"), []).append({**s, "name": name})
        else:
            named[name] = sessions
    for s in unnamed:  # a semaphore's follower holds or waits for a watch lock
        label = _LABEL.match(s["application_name"] or "")
        if s["trusted"] and label is not None and label.group("label") in semaphores:
            semaphores[label.group("label")].append({**s, "name": None})
        else:
            others.append(s)
    return named, semaphores, others, groups


def _lock_report(info: Any, name: str, sessions: Iterable[AdvisoryLock]) -> LockReport:
    listed = sorted(sessions, key=lambda s: (not s["granted"], s["wait_start_age_s"] is None,
                                             -(s["wait_start_age_s"] or 0), s["pid"]))  # fmt: skip
    first = next(iter(listed))
    holders = [_session(s) for s in listed if s["granted"]]
    waiting = [_session(s) for s in listed if not s["granted"]]
    return {
        "lock": {"name": name, "key1": first["key1"], "key2": first["key2"]},
        "database": info.database,
        "checked_at": info.now,
        "held": bool(holders),
        "holders": holders,  # type: ignore[typeddict-item]
        "waiting_count": len(waiting),
        "waiting": waiting,  # type: ignore[typeddict-item]
        "trust": info.trust,
    }


def _session(lock: AdvisoryLock) -> dict[str, Any]:
    return {k: v for k, v in lock.items() if k not in ("kind", "key", "key1", "key2", "name")}


_TERMS = (
    "SELECT key1, key2, term, acquired_at FROM {table}"
    " WHERE (key1, key2) IN"
    " (SELECT * FROM ROWS FROM (pg_catalog.unnest(%s::int4[]), pg_catalog.unnest(%s::int4[])))"
)


def _keys_of(sessions: Sequence[AdvisoryLock]) -> tuple[int, int]:
    return sessions[0]["key1"], sessions[0]["key2"]


def _terms(
    conn: psycopg.Connection[Any], table: TermTable, keys: Sequence[tuple[int, int]]
) -> tuple[dict[tuple[int, int], tuple[int, Any]], str | None]:
    """The fencing table's term (and when it began) of each of ``keys``, and why the
    table was not read (``None``: it was, or nothing was asked). The row holds the last
    fenced leader's term: a lock without fencing has none."""
    if not keys:
        return {}, None
    try:
        with conn.transaction():  # a savepoint: an error here spares the snapshot
            reason = unreadable(conn, table)
            if reason is not None:
                return {}, reason
            rows = conn.execute(
                _TERMS.format(table=table.sql).encode(),
                ([k[0] for k in keys], [k[1] for k in keys]),
            ).fetchall()
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        return {}, first_line(exc)
    return {(k1, k2): (term, at) for k1, k2, term, at in rows}, None


def _leader(report: LockReport, term: tuple[int, Any] | None) -> dict[str, Any] | None:
    """The holder, with ``since`` and ``term`` from its own participants row, else
    from the fencing table (a fenced leader that publishes no row; of a trusted role
    only)."""
    if not report["holders"]:
        return None
    holder: dict[str, Any] = dict(report["holders"][0])
    row = next(
        (
            p
            for p in report.get("participants", [])
            if p["pid"] == holder["pid"] and p["trusted"] and p["leading"]
        ),
        None,
    )
    holder["since"] = row["since"] if row is not None else None
    holder["term"] = row["term"] if row is not None else None
    if holder["term"] is None and term is not None and holder["trusted"]:
        holder["term"] = term[0]
        holder["since"] = holder["since"] or term[1]
    return holder


def _lock_view(
    report: LockReport, leader: dict[str, Any] | None, history: list[dict[str, Any]]
) -> dict[str, Any]:
    view: dict[str, Any] = dict(report)
    for key in ("database", "checked_at", "trust"):
        view.pop(key)
    view["leader"] = leader
    view["history"] = history
    view["untrusted_rows"] = [p for p in report.get("participants", []) if not p["trusted"]]
    return view


def _semaphore_view(name: str, sessions: list[AdvisoryLock]) -> dict[str, Any]:
    slots: dict[int, dict[str, Any]] = {}
    followers = []
    for s in sorted(sessions, key=lambda s: s["pid"]):
        slot = _SLOT.match(s.get("name") or "")
        if slot is None:
            followers.append(_brief(s))
            continue
        entry = slots.setdefault(
            int(slot.group("slot")),
            {"slot": int(slot.group("slot")), "key1": s["key1"], "key2": s["key2"],
             "holder": None, "waiting": []},
        )  # fmt: skip
        if s["granted"]:
            entry["holder"] = _brief(s)
        else:
            entry["waiting"].append(_brief(s))
    held = [slots[i] for i in sorted(slots)]
    return {
        "name": name,
        "slots": held,
        "held": sum(1 for s in held if s["holder"] is not None),
        "followers": followers,
    }


def _group_view(report: Any, checkpoints_not_read: str | None) -> dict[str, Any]:
    view: dict[str, Any] = {
        k: v for k, v in report.items() if k not in ("database", "checked_at", "trust")
    }
    names: dict[str, list[str]] = {m["member"]: [] for m in report["members"]}
    for leader in report["leaders"]:
        if leader["member"] in names:
            names[leader["member"]].append(leader["name"] or f"({leader['key1']},{leader['key2']})")
    counts = [m["names"] for m in report["members"]]
    view["names_by_member"] = {m: sorted(n) for m, n in names.items()}
    view["balance"] = {
        "spread": (max(counts) - min(counts)) if counts else 0,
        "balanced": not counts or max(counts) - min(counts) <= 1,
    }
    view["checkpoints_not_read"] = checkpoints_not_read
    return view


_BRIEF = ("pid", "granted", "application_name", "usename", "trusted", "impostor",
          "backend_start", "wait_start_age_s", "client_addr")  # fmt: skip


def _brief(s: Any) -> dict[str, Any]:
    return {k: s.get(k) for k in _BRIEF}


def _keys(s: Any) -> dict[str, Any]:
    return {k: s[k] for k in ("kind", "key", "key1", "key2") if k in s}
