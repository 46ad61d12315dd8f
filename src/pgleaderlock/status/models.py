"""The reports' shapes: plain, typed dicts (`typing.TypedDict`), so that a report is
also its JSON (``pgleaderlock status --json``, ``manage.py pgleaderlock_status --json``)
with `pgleaderlock.status.render.json_default` for its timestamps.

Every string in them may have been written by another role (an ``application_name``, a
participant's identity and metadata, a run's holder and detail): escape them before a
terminal shows them (`pgleaderlock.core.text.printable_tree`; the text renderers do).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NotRequired, TypedDict

__all__ = [
    "AdvisoryLock",
    "AllLocksReport",
    "GroupReport",
    "LockName",
    "LockReport",
    "Member",
    "MemberSession",
    "NameLeader",
    "ParticipantRow",
    "Run",
    "ScheduleItem",
    "ScheduleReport",
    "Session",
    "TableRead",
    "Trust",
    "Waiter",
]


class Trust(TypedDict):
    """Whose sessions a report trusts, besides superusers: the reading role
    (``user``) and the ``trusted_roles`` it was given."""

    user: str
    trusted_roles: list[str]


class TableRead(TypedDict):
    """One of the library's tables that a report reads: its qualified name, and why it
    was not read (``None``: it was)."""

    table: str
    not_read: str | None


class Session(TypedDict):
    """A session holding or waiting for an advisory lock (``pg_locks`` joined with
    ``pg_stat_activity``). ``group``, ``member`` and ``role`` decode a coordinator's
    ``application_name`` (``pgl:GROUP:MEMBER:ROLE``) of a trusted role; ``impostor``:
    the name claims a pgleaderlock session, the role is not trusted. ``identity``,
    ``priority`` and ``metadata`` are set when the participants table was read."""

    pid: int
    granted: bool | None
    mode: str | None
    application_name: str | None
    client_addr: str | None
    client_port: int | None
    usename: str | None
    backend_start: datetime | None
    state_change: datetime | None
    state: str | None
    wait_start: datetime | None
    trusted: bool
    backend_start_age_s: float | None
    state_change_age_s: float | None
    wait_start_age_s: float | None
    group: str | None
    member: str | None
    role: str | None
    impostor: bool
    identity: NotRequired[str | None]
    priority: NotRequired[int | None]
    metadata: NotRequired[Any]


class LockName(TypedDict):
    """A lock: its name (``None`` for one given by its keys) and keys."""

    name: str | None
    key1: int
    key2: int


class ParticipantRow(TypedDict):
    """A live row of the participants table: what a session published."""

    pid: int
    application_name: str | None
    usename: str | None
    identity: str | None
    name: str | None
    priority: int | None
    metadata: Any
    since: datetime | None
    term: int | None
    eligible: bool
    leading: bool
    waiting: bool
    trusted: bool
    skipped: list[str]


class Run(TypedDict):
    """A run in the schedule ledger."""

    slot: datetime
    term: int | None
    holder: str | None
    outcome: str | None
    attempt: int | None
    started_at: datetime | None
    finished_at: datetime | None
    detail: str | None


class ScheduleItem(TypedDict):
    """A schedule in the ledger: its spec, next slot, how many kept runs ended in each
    outcome, and its last runs (newest first). ``job``: its name after the prefix
    asked for (``<lock>:``)."""

    schedule: str
    job: str
    spec: str | None
    since: datetime | None
    next_slot: datetime | None
    updated_at: datetime | None
    outcomes: dict[str, int]
    last_runs: list[Run]


class ScheduleReport(TypedDict):
    """The schedules in the ledger. ``not_read``: why the tables were not read;
    ``absent``: which is missing (no schedule ran yet, no error)."""

    table: str
    runs_table: str
    not_read: str | None
    absent: str | None
    items: list[ScheduleItem]


class LockReport(TypedDict):
    """Who holds one lock and who waits for it; with the participants table read,
    what each session published and the observers; with a lock name, its schedules."""

    lock: LockName
    database: str
    checked_at: datetime
    held: bool
    holders: list[Session]
    waiting_count: int
    waiting: list[Session]
    trust: Trust
    participants_table: NotRequired[TableRead]
    participants: NotRequired[list[ParticipantRow]]
    observers: NotRequired[list[ParticipantRow]]
    schedules: NotRequired[ScheduleReport]


class AdvisoryLock(Session):
    """A session's advisory lock in the database: ``kind`` ``"int4 pair"`` (``key1``,
    ``key2``, and ``name`` when a pgleaderlock holder's name gives those keys) or
    ``"bigint"`` (``key``)."""

    kind: str
    key: NotRequired[int]
    key1: NotRequired[int]
    key2: NotRequired[int]
    name: NotRequired[str | None]


class AllLocksReport(TypedDict):
    """Every advisory lock held or awaited in the database."""

    database: str
    checked_at: datetime
    locks: list[AdvisoryLock]
    trust: Trust


class MemberSession(TypedDict):
    """A group member's session (a `Session` without the lock's fields)."""

    pid: int
    role: str | None
    application_name: str | None
    client_addr: str | None
    client_port: int | None
    usename: str | None
    backend_start: datetime | None
    backend_start_age_s: float | None
    state: str | None
    impostor: bool


class Member(TypedDict):
    """A live member of a group: its session mode (``shared``, ``dedicated``), how many
    names it leads, its sessions, and whose member lock it watches."""

    member: str
    mode: str | None
    names: int
    sessions: list[MemberSession]
    watching: str | None


class Waiter(TypedDict):
    """A session waiting for a name (``member`` ``""``: outside the group)."""

    member: str | None
    pid: int
    role: str | None
    application_name: str | None
    usename: str | None
    impostor: bool
    wait_start_age_s: float | None


class NameLeader(TypedDict):
    """Who leads one name of a group (``member`` ``""``: a session outside the
    group; ``None``: nobody), and who waits for it."""

    name: str | None
    key1: int
    key2: int
    member: str | None
    pid: int | None
    role: str | None
    application_name: str | None
    usename: str | None
    impostor: bool
    waiting: list[Waiter]


class GroupReport(TypedDict):
    """Who leads what in a coordinator's group: its members, each name's leader and
    waiting sessions, and the impostors (sessions named like the group's, of roles
    not trusted)."""

    group: str
    database: str
    checked_at: datetime
    trust: Trust
    members: list[Member]
    leaders: list[NameLeader]
    impostors: list[MemberSession]
    checkpoint_table: NotRequired[TableRead]
