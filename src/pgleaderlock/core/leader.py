"""Who leads a lock: [`LeaderInfo`][pgleaderlock.LeaderInfo], read from the server.

The authority is ``pg_locks``: the session granted the lock's advisory lock leads. Its
pid, ``application_name`` and role come from ``pg_stat_activity`` (visible to every
role). What a lock publishes about itself (its identity, priority and ``metadata``)
lives in a table of the library's own,
[`ParticipantTable`][pgleaderlock.core.leader.ParticipantTable]
(``pgleaderlock_participants``): one row per lock session, keyed by the lock's keys, the
session's pid and its identity, written by each lock on its own session when it
connects, and updated with ``since`` (and the fencing term) when it starts to lead.

A row counts only while it is *that* session's: its pid is the one ``pg_locks`` shows
holding the lock now, its ``backend_start`` is that backend's (a pid the server reused
for another backend does not inherit the row), and its writer is that backend's role.
A stale row (its session ended) is ignored, and pruned by the next lock that connects.
Row-level security on the table lets a role write only its own backend's rows
(``WITH CHECK (pid = pg_backend_pid())``), so a role allowed to write the table still
cannot forge another session's row; the table is used only when a trusted role owns it
(see [`LibraryTable`][pgleaderlock.core.tables.LibraryTable]).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, cast

from ._logging import get_logger
from .config import SAFE_SETTINGS, check_roles, positive
from .errors import ConfigurationError
from .keys import check_key, key_to_oid, lock_keys
from .registry import resolve, wrap_connection
from .session import (
    Backend,
    ConnectOptions,
    LockSession,
    QuerySession,
    SessionFactory,
    SetupSession,
)
from .tables import CHECK_TABLE, DEFAULT_SCHEMA, LibraryTable, TableCheck, trusted_roles_sql

__all__ = [
    "CHANNEL",
    "LeaderInfo",
    "LeaderReader",
    "Participant",
    "ParticipantTable",
    "Target",
    "current_leader",
    "current_leader_sync",
    "open_session",
]

log = get_logger()

CHANNEL = "pgleaderlock_leader"
"""The ``NOTIFY`` channel a lock announces its leadership on (payload ``"key1,key2"``).
Any role may notify on it: a message only makes listeners look at ``pg_locks`` again."""

METADATA_MAX_BYTES = 8000
"""The largest ``metadata`` document a lock publishes (as JSON)."""


@dataclass(frozen=True)
class ParticipantTable(LibraryTable):
    """The locks' published details: one row per (lock keys, session pid, identity).

    Created with row-level security: a session may insert and update only rows of its
    own backend (pid and ``backend_start``), and delete only those or rows whose session
    has ended. Everyone who may read the table reads every row.
    """

    name: str = "pgleaderlock_participants"

    knobs: ClassVar[tuple[str, str]] = ("participants_table", "participants_schema")
    privileges: ClassVar[tuple[str, ...]] = ("SELECT", "INSERT", "UPDATE", "DELETE")
    columns: ClassVar[str] = (
        "key1 int4 NOT NULL, key2 int4 NOT NULL, pid int4 NOT NULL,"
        " backend_start timestamptz NOT NULL, identity text NOT NULL, name text,"
        " priority int4, eligible bool NOT NULL, metadata jsonb, since timestamptz,"
        " term int8, writer name NOT NULL, updated_at timestamptz NOT NULL,"
        " reserved_for text, reserved_until timestamptz,"
        " PRIMARY KEY (key1, key2, pid, identity)"
    )

    @property
    def create(self) -> str:
        """The table, with row-level security (forced, so that its owner's sessions are
        held to it too) and its policies, in one ``DO`` block."""
        t = self.sql
        me = "pg_catalog.pg_backend_pid()"
        own_start = (
            f"(SELECT a.backend_start FROM pg_catalog.pg_stat_activity a WHERE a.pid = {me})"
        )
        own = f"pid = {me} AND backend_start = {own_start} AND writer = current_user"
        ended = (
            "NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a"
            f' WHERE a.pid = "{self.name}".pid AND (a.backend_start IS NULL'
            f' OR a.backend_start = "{self.name}".backend_start))'
        )
        literal = t.replace("'", "''")
        return (
            "DO $pgleaderlock$ BEGIN"
            f" CREATE TABLE IF NOT EXISTS {t} ({self.columns});"
            f" ALTER TABLE {t} ENABLE ROW LEVEL SECURITY;"
            f" ALTER TABLE {t} FORCE ROW LEVEL SECURITY;"
            " IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_policy"
            f" WHERE polrelid = '{literal}'::regclass AND polname = 'pgleaderlock_read') THEN"
            f" CREATE POLICY pgleaderlock_read ON {t} FOR SELECT USING (true);"
            f" CREATE POLICY pgleaderlock_insert ON {t} FOR INSERT WITH CHECK ({own});"
            f" CREATE POLICY pgleaderlock_update ON {t} FOR UPDATE USING (pid = {me})"
            f" WITH CHECK ({own});"
            f" CREATE POLICY pgleaderlock_delete ON {t} FOR DELETE"
            f" USING (pid = {me} OR {ended});"
            " END IF; END $pgleaderlock$"
        )

    def upsert(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity, ``{3}`` name, ``{4}`` priority,
        ``{5}`` eligible, ``{6}`` metadata (JSON text), ``{7}`` whether to notify,
        ``{8}`` channel, ``{9}`` payload: this session's row, after pruning the rows of
        ended sessions of the same lock; with ``{7}``, ``NOTIFY`` (a candidate with a
        priority joins: the leader looks whether to hand over)."""
        return (
            f"WITH {self._upsert()}"
            " SELECT (SELECT count(*) FROM up), (SELECT count(*) FROM (SELECT"
            " pg_catalog.pg_notify(({8})::text, ({9})::text) WHERE ({7})::bool) n)"
        )

    def _upsert(self) -> str:
        """The ``pruned`` and ``up`` CTEs of `upsert`."""
        t = self.sql
        return (
            f"pruned AS (DELETE FROM {t} p WHERE p.key1 = ({{0}})::int4"
            " AND p.key2 = ({1})::int4 AND NOT EXISTS (SELECT 1 FROM"
            " pg_catalog.pg_stat_activity a WHERE a.pid = p.pid AND (a.backend_start IS NULL"
            " OR a.backend_start = p.backend_start)) RETURNING 1),"
            f" up AS (INSERT INTO {t} AS p (key1, key2, pid, backend_start, identity, name,"
            " priority, eligible, metadata, writer, updated_at)"
            " SELECT ({0})::int4, ({1})::int4, a.pid, a.backend_start, ({2})::text,"
            " ({3})::text, ({4})::int4, ({5})::bool, ({6})::text::jsonb, current_user,"
            " pg_catalog.clock_timestamp() FROM pg_catalog.pg_stat_activity a"
            " WHERE a.pid = pg_catalog.pg_backend_pid()"
            " ON CONFLICT (key1, key2, pid, identity) DO UPDATE SET"
            " backend_start = EXCLUDED.backend_start, name = EXCLUDED.name,"
            " priority = EXCLUDED.priority, eligible = EXCLUDED.eligible,"
            " metadata = EXCLUDED.metadata, writer = EXCLUDED.writer, since = NULL,"
            " term = NULL, reserved_for = NULL, reserved_until = NULL,"
            " updated_at = EXCLUDED.updated_at RETURNING 1)"
        )

    def reserve(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity, ``{3}`` the target's identity, ``{4}``
        seconds, ``{5}`` ``{6}`` the keys as oids: the leader's reservation of the lock
        for the target, on its own row, if the target (a live, eligible participant)
        waits for the lock now: candidates granted the lock meanwhile, but for the
        target, let it go again (see ``reserved_elsewhere``). No row: not reserved."""
        t = self.sql
        return (
            f"UPDATE {t} SET reserved_for = ({{3}})::text,"
            " reserved_until = pg_catalog.clock_timestamp()"
            " + ({4})::float8 * interval '1 second'"
            " WHERE key1 = ({0})::int4 AND key2 = ({1})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({2})::text"
            f" AND EXISTS (SELECT 1 FROM {t} w JOIN pg_catalog.pg_stat_activity a"
            " ON a.pid = w.pid AND a.backend_start = w.backend_start AND a.usename = w.writer"
            " JOIN pg_catalog.pg_locks l ON l.pid = w.pid AND NOT l.granted"
            f" AND {_on_lock(5, 6)}"
            " WHERE w.key1 = ({0})::int4 AND w.key2 = ({1})::int4"
            " AND w.identity = ({3})::text AND w.eligible)"
            " RETURNING 1"
        )

    def reserved_elsewhere(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` ``{3}`` the keys as oids, ``{4}`` this lock's
        identity, ``{5}`` trusted roles: is the lock reserved for another candidate, one
        that is waiting for it now? Only a reservation written by a trusted role, not
        expired, counts: one of another role, or for a target that is gone or no longer
        waits, is ignored. If it is, the lock (just granted to this session) is let go
        in the same statement. Returns (reserved, unlocked)."""
        return (
            f"WITH trusted AS ({trusted_roles_sql('{5}')}),"
            f" r AS (SELECT {self._reserved()} AS reserved)"
            f" SELECT (SELECT reserved FROM r), {_LET_GO}"
        )

    def _reserved(self) -> str:
        t = self.sql
        return (
            f"EXISTS (SELECT 1 FROM {t} r JOIN {t} w ON w.key1 = r.key1"
            " AND w.key2 = r.key2 AND w.identity = r.reserved_for AND w.eligible"
            " JOIN pg_catalog.pg_stat_activity a ON a.pid = w.pid"
            " AND a.backend_start = w.backend_start AND a.usename = w.writer"
            " JOIN pg_catalog.pg_roles o ON o.rolname = r.writer"
            " WHERE r.key1 = ({0})::int4 AND r.key2 = ({1})::int4"
            " AND r.reserved_for IS NOT NULL AND r.reserved_for <> ({4})::text"
            " AND r.reserved_until > pg_catalog.clock_timestamp()"
            " AND o.oid IN (SELECT oid FROM trusted)"
            " AND EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = w.pid"
            f" AND NOT l.granted AND {_on_lock(2, 3)}))"
        )

    def admit(self) -> str:
        """The values of ``reserved_elsewhere``, then ``{6}`` channel, ``{7}``
        payload: unless the lock is reserved for another, also what ``announce`` does
        for a lock without fencing, in the same round trip from the grant to the
        announcement. Returns (reserved, unlocked, rows marked, notified)."""
        now = "pg_catalog.clock_timestamp()"
        return (
            f"WITH trusted AS ({trusted_roles_sql('{5}')}),"
            f" r AS (SELECT {self._reserved()} AS reserved),"
            f" up AS (UPDATE {self.sql} SET since = {now}, term = NULL, updated_at = {now}"
            " WHERE key1 = ({0})::int4 AND key2 = ({1})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({4})::text"
            " AND NOT (SELECT reserved FROM r) RETURNING 1)"
            f" SELECT (SELECT reserved FROM r), {_LET_GO}, (SELECT count(*) FROM up),"
            " (SELECT count(*) FROM (SELECT pg_catalog.pg_notify(({6})::text, ({7})::text)"
            " WHERE NOT (SELECT reserved FROM r)) n)"
        )

    def remove(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity: this session's row goes."""
        return (
            f"DELETE FROM {self.sql} WHERE key1 = ({{0}})::int4 AND key2 = ({{1}})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({2})::text RETURNING 1"
        )

    def announce(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity, ``{3}`` term, ``{4}`` channel,
        ``{5}`` payload: mark this session's row as leading since now, and notify."""
        return (
            f"WITH up AS (UPDATE {self.sql} SET since = pg_catalog.clock_timestamp(),"
            " term = ({3})::int8, updated_at = pg_catalog.clock_timestamp()"
            " WHERE key1 = ({0})::int4 AND key2 = ({1})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({2})::text RETURNING 1)"
            " SELECT pg_catalog.pg_notify(({4})::text, ({5})::text), (SELECT count(*) FROM up)"
        )


_LET_GO = (
    "(SELECT count(*) FROM (SELECT pg_catalog.pg_advisory_unlock(({0})::int4, ({1})::int4)"
    " WHERE (SELECT reserved FROM r)) u)"
)
"""With a ``reserved`` CTE ``r``: let the lock go when it is reserved for another."""

NOTIFY_ONLY = "SELECT pg_catalog.pg_notify(({0})::text, ({1})::text)"
"""``{0}`` channel, ``{1}`` payload: the announcement when the table cannot be used."""

_DATABASE = "(SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())"


def _on_lock(classid: int, objid: int) -> str:
    """The condition on ``pg_locks l`` for a two-key advisory lock of this database, the
    keys (as oids) in placeholders ``{classid}`` and ``{objid}``."""
    return (
        f"l.locktype = 'advisory' AND l.objsubid = 2 AND l.database = {_DATABASE}"
        f" AND l.classid = ({{{classid}}})::int8::oid AND l.objid = ({{{objid}}})::int8::oid"
    )


_HOLDER = (
    "FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
    f" WHERE l.granted AND {_on_lock(0, 1)}"
)
LEADER = f"SELECT l.pid, a.application_name, a.usename::text {_HOLDER}"
"""``{0}`` ``{1}`` the keys as oids: the session granted the lock, if any."""


def leader_with(table: ParticipantTable) -> str:
    """``{0}`` ``{1}`` the keys as oids, ``{2}`` ``{3}`` the keys: the session granted the
    lock and its published row, if that row is still the session's."""
    return (
        "SELECT l.pid, a.application_name, a.usename::text, p.identity, p.name, p.priority,"
        " p.metadata::text, p.since, p.term"
        " FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        f" LEFT JOIN LATERAL (SELECT * FROM {table.sql} p WHERE p.key1 = ({{2}})::int4"
        " AND p.key2 = ({3})::int4 AND p.pid = l.pid AND p.backend_start = a.backend_start"
        " AND p.writer = a.usename AND p.eligible"
        " ORDER BY p.since DESC NULLS LAST LIMIT 1) p ON true"
        f" WHERE l.granted AND {_on_lock(0, 1)}"
    )


def participants_of(table: ParticipantTable) -> str:
    """``{0}`` ``{1}`` the keys as oids, ``{2}`` ``{3}`` the keys: every live
    participant's row, whether its session holds the lock, and whether it waits."""
    lock = f"SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = p.pid AND {_on_lock(0, 1)}"
    return (
        "SELECT p.pid, a.application_name, a.usename::text, p.identity, p.name, p.priority,"
        " p.metadata::text, p.since, p.term, p.eligible,"
        f" EXISTS ({lock} AND l.granted), EXISTS ({lock} AND NOT l.granted)"
        f" FROM {table.sql} p JOIN pg_catalog.pg_stat_activity a ON a.pid = p.pid"
        " AND a.backend_start = p.backend_start AND a.usename = p.writer"
        " WHERE p.key1 = ({2})::int4 AND p.key2 = ({3})::int4 ORDER BY p.pid, p.identity"
    )


@dataclass(frozen=True)
class LeaderInfo:
    """Who leads a lock, as the server says at one instant.

    The session granted the lock's advisory lock (``pg_locks``) leads; what it published
    (``identity``, ``priority``, ``metadata``, ``since``, ``term``) is included only
    while its row in the participants table is that very session's, and ``None``
    otherwise (no such table, no privilege to read it, a leader that is not a
    `LeaderLock`, or one that has not announced itself yet).

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
        term: its fencing term (``fencing=True``), else ``None``.
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
        }


@dataclass(frozen=True)
class Participant:
    """One live lock session's published row (for status and priorities).

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


def _metadata(text: object) -> Mapping[str, Any] | None:
    if text is None:
        return None
    value = json.loads(cast(str, text))
    return value if isinstance(value, dict) else {"value": value}


def _info(keys: tuple[int, int], row: Sequence[Any]) -> LeaderInfo:
    pid, app, role, *rest = row
    if not rest:
        return LeaderInfo(keys, int(pid), app, role)
    identity, name, priority, metadata, since, term = rest[:6]
    return LeaderInfo(
        keys, int(pid), app, role, identity, name,
        None if priority is None else int(priority), _metadata(metadata), since,
        None if term is None else int(term),
    )  # fmt: skip


def check_metadata(metadata: Mapping[str, Any] | None) -> str | None:
    """``metadata`` as JSON text (``None`` stays ``None``).

    Raises:
        ConfigurationError: not a JSON object, or larger than ``METADATA_MAX_BYTES``.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise ConfigurationError(f"metadata must be a mapping (a JSON object), got {metadata!r}")
    try:
        text = json.dumps(dict(metadata), separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"metadata must be JSON-serialisable: {exc}") from None
    if len(text.encode()) > METADATA_MAX_BYTES:
        raise ConfigurationError(
            f"metadata is {len(text.encode())} bytes as JSON; at most {METADATA_MAX_BYTES}"
        )
    return text


class LeaderReader:
    """Reads who leads on one session of the caller's (a
    [`QuerySession`][pgleaderlock.backends.QuerySession]); checks once per reader
    whether the participants table may be trusted and read.

    Args:
        session: the session to read on (not the lock's own: that one may be blocked
            in a wait for the lock).
        table: the participants table.
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
        self.readable: bool | None = None  # the table: unknown until checked
        self.reason: str | None = None  # why it is not readable

    async def _check(self) -> bool:
        # A table found readable stays so for the session; one that was not (not made
        # yet, say: the first lock creates it) is looked at again at the next read.
        if not self.readable:
            self.reason = None
            t = self._table
            rows = await self._session.query(CHECK_TABLE, (t.schema, t.name, list(t.trusted_roles)))
            self.reason = TableCheck(t, *rows[0][:9]).unreadable()
            self.readable = self.reason is None
            if self.reason is not None:
                log.debug("participants_unreadable", reason=self.reason, lock=self._label)
        return self.readable

    async def leader(self, keys: tuple[int, int]) -> LeaderInfo | None:
        """Who leads the lock of ``keys`` now, or ``None``."""
        oids = (key_to_oid(keys[0]), key_to_oid(keys[1]))
        if await self._check():
            rows = await self._session.query(leader_with(self._table), (*oids, *keys))
        else:
            rows = await self._session.query(LEADER, oids)
        return _info(keys, rows[0]) if rows else None

    async def participants(self, keys: tuple[int, int]) -> list[Participant]:
        """Every live participant of the lock of ``keys`` (none when the table cannot
        be read)."""
        if not await self._check():
            return []
        oids = (key_to_oid(keys[0]), key_to_oid(keys[1]))
        rows = await self._session.query(participants_of(self._table), (*oids, *keys))
        return [
            Participant(_info(keys, row[:9]), bool(row[9]), bool(row[10]), bool(row[11]))
            for row in rows
        ]


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
