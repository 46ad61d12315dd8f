"""Who leads a lock: [`LeaderInfo`][pgleaderlock.LeaderInfo], read from the server.

The authority is ``pg_locks``: the session granted the lock's advisory lock leads. Its
pid, ``application_name`` and role come from ``pg_stat_activity`` (visible to every
role), and so does whether that role is *trusted* (the reader's own role, a superuser,
or one of ``trusted_roles``). What a lock publishes about itself (its identity,
priority and ``metadata``) lives in the library's
[`ParticipantTable`][pgleaderlock.core.participants.ParticipantTable]
(``pgleaderlock_participants``), written by each lock on its own session when it
connects, and updated with ``since`` (and the fencing term) when it starts to lead.

A row counts only while it is *that* session's (its pid holds the lock now, its
``backend_start`` is that backend's, its writer is that backend's role), only when that
role is trusted, and only as far as its values can be represented: see
[`pgleaderlock.core.participants`][] for who may write what, and
[`published`][pgleaderlock.core.leader.published] for what a reader skips (and logs).
A leader of an untrusted role is named (pid, ``application_name``, role, marked
``trusted=False``) with nothing of what it published.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ._logging import get_logger
from .config import SAFE_SETTINGS, check_roles, positive
from .errors import ConfigurationError
from .keys import check_key, key_to_oid, lock_keys
from .metadata import check_metadata, read_metadata
from .participants import LEADER, ParticipantTable, leader_with, participants_of
from .registry import resolve, wrap_connection
from .session import (
    Backend,
    ConnectOptions,
    LockSession,
    QuerySession,
    SessionFactory,
    SetupSession,
)
from .tables import CHECK_TABLE, DEFAULT_SCHEMA, TableCheck

__all__ = [
    "CHANNEL",
    "LeaderInfo",
    "LeaderReader",
    "Participant",
    "ParticipantTable",
    "Target",
    "check_metadata",
    "current_leader",
    "current_leader_sync",
    "open_session",
    "published",
]

log = get_logger()

CHANNEL = "pgleaderlock_leader"
"""The ``NOTIFY`` channel a lock announces its leadership on (payload ``"key1,key2"``).
Any role may notify on it: a message only makes listeners look at ``pg_locks`` again."""


@dataclass(frozen=True)
class LeaderInfo:
    """Who leads a lock, as the server says at one instant.

    The session granted the lock's advisory lock (``pg_locks``) leads; what it published
    (``identity``, ``priority``, ``metadata``, ``since``, ``term``) is included only
    while its row in the participants table is that very session's and its role is
    trusted, and ``None`` otherwise (no such table, no privilege to read it, a leader
    that is not a `LeaderLock`, one that has not announced itself yet, or a leader of a
    role that is not trusted: ``trusted`` is then ``False``).

    Attributes:
        keys: the lock's ``(key1, key2)``.
        pid: the leader's server backend pid.
        application_name: the leader session's ``application_name``.
        role: the leader session's role.
        identity: the leader's ``identity`` (see `LeaderLock`).
        name: the leader's lock name, if it has one.
        priority: the leader's ``priority``.
        metadata: the JSON document the leader publishes (``metadata=``).
        since: when the leader announced its current leadership (server clock).
        term: its fencing term (``Fencing(enabled=True)``), else ``None``.
        trusted: whether the leader's role is trusted by the reader (its own role, a
            superuser, or one of ``trusted_roles``). An untrusted leader holds the
            lock all the same (advisory locks have no owner), but nothing it published
            is read: never forward traffic to it.
    """

    keys: tuple[int, int]
    pid: int
    application_name: str | None
    role: str | None
    identity: str | None = None
    name: str | None = None
    priority: int | None = None
    metadata: Mapping[str, Any] | None = None
    since: datetime | None = None
    term: int | None = None
    trusted: bool = False

    @property
    def published(self) -> bool:
        """Whether the leader's published row was found (its ``identity`` is known)."""
        return self.identity is not None

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (``since`` as ISO 8601), for JSON."""
        return {
            "keys": list(self.keys),
            "pid": self.pid,
            "application_name": self.application_name,
            "role": self.role,
            "identity": self.identity,
            "name": self.name,
            "priority": self.priority,
            "metadata": dict(self.metadata) if self.metadata is not None else None,
            "since": self.since.isoformat() if self.since is not None else None,
            "term": self.term,
            "trusted": self.trusted,
        }


@dataclass(frozen=True)
class Participant:
    """One live lock session's published row (for status and priorities), of a trusted
    role.

    Attributes:
        info: what it published, as a [`LeaderInfo`][pgleaderlock.LeaderInfo].
        eligible: ``False`` for an observer (``eligible=False``).
        leading: its session holds the lock now.
        waiting: its session waits for the lock on the server now.
    """

    info: LeaderInfo
    eligible: bool
    leading: bool
    waiting: bool


PUBLISHED_FIELDS = 9
"""How many fields of a row [`published`][pgleaderlock.core.leader.published] reads
(``participants.PUBLISHED``)."""


def published(keys: tuple[int, int], row: Sequence[Any]) -> tuple[LeaderInfo, tuple[str, ...]]:
    """A row of a lock session (``pid, application_name, role, trusted``, then the
    fields of ``participants.PUBLISHED``, if the table was read) as a
    [`LeaderInfo`][pgleaderlock.LeaderInfo], with what was skipped and why, for the log.
    The server sent nothing it could not bound (too long, too large, a timestamp no
    client can represent): such a value is skipped (``None``), and so is a document this
    library would not accept as ``metadata`` (too deep, a non-finite number...); without
    an identity the whole row is. Never raises."""
    pid, app, role, trusted, *rest = row[: 4 + PUBLISHED_FIELDS]
    head = (keys, int(pid), app, role)
    if not rest:
        return LeaderInfo(*head, trusted=bool(trusted)), ()
    identity, name, has_name, priority, metadata, has_metadata, since, has_since, term = rest
    problems: list[str] = []
    if identity is None:
        if has_name or has_metadata or has_since or priority is not None or term is not None:
            problems.append("identity is too long: the row is skipped")
        return LeaderInfo(*head, trusted=bool(trusted)), tuple(problems)
    if name is None and has_name:
        problems.append("name is too long")
    document = None
    if metadata is not None:
        document, why = read_metadata(str(metadata))
        if why is not None:
            problems.append(f"metadata skipped: {why}")
    elif has_metadata:
        problems.append("metadata skipped: it is too large")
    if since is None and has_since:
        problems.append("since skipped: a time no client can represent")
    info = LeaderInfo(
        *head, str(identity), None if name is None else str(name),
        None if priority is None else int(priority), document,
        since if isinstance(since, datetime) else None,
        None if term is None else int(term), bool(trusted),
    )  # fmt: skip
    return info, tuple(problems)


_RECHECK_S = 60.0
"""How often a reader checks the participants table again while it finds it usable: a
table whose row-level security its owner turned off meanwhile is not read for longer."""


class LeaderReader:
    """Reads who leads on one session of the caller's (a
    [`QuerySession`][pgleaderlock.backends.QuerySession]); checks whether the
    participants table may be trusted and read (again every minute), and logs each row
    it skips (once per session, row and reason).

    Args:
        session: the session to read on (not the lock's own: that one may be blocked
            in a wait for the lock).
        table: the participants table (its ``trusted_roles`` are the reader's).
        label: the lock's label, for logs.
    """

    def __init__(self, session: LockSession, table: ParticipantTable, label: str = "") -> None:
        if not isinstance(session, QuerySession):
            raise ConfigurationError(
                f"reading who leads needs a session that can run queries; {session!r} cannot"
            )
        self._session: QuerySession = session
        self._table = table
        self._label = label
        self._roles = list(table.trusted_roles)
        self.readable: bool | None = None  # the table: unknown until checked
        self.reason: str | None = None  # why it is not readable
        self._checked_at = 0.0
        self._logged: set[tuple[object, ...]] = set()

    async def _check(self) -> bool:
        # A table found readable is looked at again after a minute; one that was not
        # (not made yet, say: the first lock creates it) at the next read.
        now = asyncio.get_running_loop().time()
        if not self.readable or now - self._checked_at >= _RECHECK_S:
            self.reason = None
            t = self._table
            rows = await self._session.query(CHECK_TABLE, (t.schema, t.name, self._roles))
            self._checked_at = now
            check = TableCheck.of(t, rows[0])
            self.reason = check.unreadable()
            self.readable = self.reason is None
            if self.reason is not None:
                # A table not made (yet) is no news; one refused (another role's, its
                # row-level security weakened) is logged once per reader and reason.
                absent = check.schema_owner is None or check.relkind is None
                self._log_once(("unreadable", self.reason), "participants_unreadable",
                               warn=not absent, reason=self.reason)  # fmt: skip
        return self.readable

    def _log_once(
        self, key: tuple[object, ...], event: str, *, warn: bool = True, **fields: Any
    ) -> None:
        if key in self._logged:
            return
        if len(self._logged) >= 1000:
            self._logged.clear()
        self._logged.add(key)
        (log.warning if warn else log.debug)(event, lock=self._label, **fields)

    def _info(self, keys: tuple[int, int], row: Sequence[Any]) -> LeaderInfo:
        info, problems = published(keys, row)
        if problems:
            self._log_once((info.pid, info.identity, problems), "participant_row_skipped",
                           pid=info.pid, role=info.role, identity=info.identity,
                           problems=list(problems))  # fmt: skip
        return info

    async def leader(self, keys: tuple[int, int]) -> LeaderInfo | None:
        """Who leads the lock of ``keys`` now, or ``None``."""
        oids = (key_to_oid(keys[0]), key_to_oid(keys[1]))
        if await self._check():
            rows = await self._session.query(leader_with(self._table), (*oids, *keys, self._roles))
        else:
            rows = await self._session.query(LEADER, (*oids, self._roles))
        return self._info(keys, rows[0]) if rows else None

    async def participants(self, keys: tuple[int, int]) -> list[Participant]:
        """Every live participant of the lock of ``keys`` whose role is trusted (none
        when the table cannot be read); rows that cannot be read are skipped."""
        if not await self._check():
            return []
        oids = (key_to_oid(keys[0]), key_to_oid(keys[1]))
        values = (*oids, *keys, self._roles, False)
        rows = await self._session.query(participants_of(self._table), values)
        found = []
        for row in rows:
            info = self._info(keys, row[: 4 + PUBLISHED_FIELDS])
            if info.identity is not None and info.trusted:
                found.append(Participant(info, *(bool(v) for v in row[4 + PUBLISHED_FIELDS :])))
        return found


@dataclass(frozen=True)
class Target:
    """How to open a session for reading: a backend and its DSN, or a ``connect_fn``."""

    backend: Backend | None
    dsn: Any
    connect_fn: SessionFactory | None = None
    connect_timeout_s: float = 5.0

    @classmethod
    def of(cls, dsn: str | Any, backend: str | None, connect_timeout_s: float) -> Target:
        """The target of ``dsn``, its backend ``backend`` or the DSN's, checked.

        Raises:
            ConfigurationError: a bad DSN, or no such backend.
        """
        found, driver_dsn = resolve(backend, dsn)
        found.check_dsn(driver_dsn)
        return cls(found, driver_dsn, connect_timeout_s=connect_timeout_s)

    @property
    def key(self) -> tuple[Any, ...]:
        """Locks with the same key share a watch."""
        if self.connect_fn is not None:
            return ("connect_fn", id(self.connect_fn))
        assert self.backend is not None
        dsn = self.dsn if isinstance(self.dsn, str) else id(self.dsn)
        return (self.backend.name, dsn)


async def open_session(target: Target, application_name: str) -> LockSession:
    """A new session for reading (and listening), set up like a lock's (a safe
    ``search_path``); the caller bounds the time and closes it."""
    options = ConnectOptions(
        application_name=application_name,
        connect_timeout_s=target.connect_timeout_s,
        server_settings=dict(SAFE_SETTINGS),
    )
    if target.connect_fn is not None:
        session = wrap_connection(await target.connect_fn())
    else:
        assert target.backend is not None
        session = await target.backend.connect(target.dsn, options)
    try:
        if isinstance(session, SetupSession):
            await session.identify(options)
            await session.configure(options)
    except BaseException:
        await _close(session)
        raise
    return session


@contextlib.asynccontextmanager
async def short_session(target: Target, application_name: str) -> AsyncIterator[LockSession]:
    """``async with short_session(...) as session:`` a session from
    [`open_session`][pgleaderlock.core.leader.open_session], closed on the way out; the
    caller bounds the time."""
    session = await open_session(target, application_name)
    try:
        yield session
    finally:
        await _close(session)


async def _close(session: LockSession) -> None:
    try:
        async with asyncio.timeout(5.0):
            await session.close()
    except Exception as exc:  # close() must not raise; be defensive anyway
        log.warning("session_close_failed", error=repr(exc))


def _keys(name_or_keys: str | tuple[int, int]) -> tuple[int, int]:
    if isinstance(name_or_keys, str):
        return lock_keys(name_or_keys)
    key1, key2 = name_or_keys
    return check_key("key1", key1), check_key("key2", key2)


async def current_leader(
    dsn: str | Any,
    name_or_keys: str | tuple[int, int],
    *,
    backend: str | None = None,
    participants_table: str = ParticipantTable.name,
    participants_schema: str = DEFAULT_SCHEMA,
    trusted_roles: Sequence[str] = (),
    timeout_s: float = 5.0,
) -> LeaderInfo | None:
    """Who leads a lock, without a lock of one's own: one short session reads
    ``pg_locks`` (and the participants table, when it may be trusted and read).

    Args:
        dsn: as for [`LeaderLock`][pgleaderlock.LeaderLock].
        name_or_keys: the lock's name (as for
            [`LeaderLock.from_name`][pgleaderlock.LeaderLock.from_name]) or its
            ``(key1, key2)``.
        backend: the driver backend; default from the DSN.
        participants_table: the table locks publish their details in.
        participants_schema: its schema.
        trusted_roles: roles whose table is trusted besides this session's role and
            superusers.
        timeout_s: bounds the whole call (connect, queries, close).

    Returns:
        The leader, or ``None`` when nobody holds the lock.

    Raises:
        TimeoutError: the server did not answer within ``timeout_s``.
        ConfigurationError: a bad DSN, name or keys.
    """
    keys = _keys(name_or_keys)
    timeout_s = positive("timeout_s", timeout_s)
    table = ParticipantTable(participants_table, participants_schema, check_roles(trusted_roles))
    target = Target.of(dsn, backend, timeout_s)
    label = name_or_keys if isinstance(name_or_keys, str) else f"{keys[0]},{keys[1]}"
    async with asyncio.timeout(timeout_s), short_session(target, "pgleaderlock:leader") as session:
        return await LeaderReader(session, table, label).leader(keys)


def current_leader_sync(
    dsn: str | Any, name_or_keys: str | tuple[int, int], **kwargs: Any
) -> LeaderInfo | None:
    """[`current_leader`][pgleaderlock.current_leader] for synchronous code (it runs its
    own event loop; call it from a thread that has none running)."""
    return asyncio.run(current_leader(dsn, name_or_keys, **kwargs))
