"""What every built-in adapter shares: the SQL, the row and pid checks, the error wording.

An adapter subclasses [`BaseSession`][pgleaderlock.backends.BaseSession] and writes only
driver calls: how to run one of the four statements (``_fetch``), how to close the
connection, how to watch its socket, and which library error a driver error stands for
(``_classify``, usually one lookup in a table). ``try_lock``, ``unlock``, ``holds``,
``wait_lock``, ``watch``, ``abort`` and ``close`` are written once, here.

Every statement also returns ``pg_backend_pid()``: a session whose server backend
changes between statements is behind a transaction-mode pooler, where a session-level
advisory lock is held by whichever server connection ran the statement. Such a session
is refused ([`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError]).

This module imports no driver. A third-party backend may build on it (import it as
``pgleaderlock.backends.base``, or the same names from ``pgleaderlock.backends``), or
use only the statements and [`translate`][pgleaderlock.backends.translate].
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import random
import re
import socket
import string
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ..core._logging import mask_dsn
from ..core.config import TermTable
from ..core.errors import (
    ConfigurationError,
    ConnectionError,
    PgLeaderLockError,
    ServerRefusedError,
    SessionNotDedicatedError,
    StandbyError,
)
from ..core.keys import key_to_oid
from ..core.session import ConnectOptions, SessionInfo

T = TypeVar("T")

__all__ = [
    "CANCEL_TIMEOUT_S",
    "CONNECTION_SQLSTATE_CLASSES",
    "ALIVE",
    "HOLDS",
    "NOTIFY",
    "TRY_LOCK_MANY",
    "UNLOCK_MANY",
    "LOCK_NOT_AVAILABLE",
    "IDENTIFY",
    "STATEMENTS",
    "TRY_LOCK",
    "UNLOCK",
    "WAIT_LOCK",
    "BaseSession",
    "ErrorClass",
    "Statement",
    "REFUSED_SQLSTATES",
    "DUPLICATE_TABLE",
    "bump_term_statement",
    "bump_terms_statement",
    "GROUP_SNAPSHOT",
    "by_sqlstate",
    "tcp_acknowledged",
    "check_target_session_attrs",
    "create_terms_statement",
    "configure_statement",
    "misconfigured_by_message",
    "refused_by_message",
    "check_pid",
    "lock_timeout_ms",
    "sqlstate",
    "translate",
]

ErrorClass = type[PgLeaderLockError]
"""A library error class, as a driver's error table maps to."""


# ---------------------------------------------------------------- the SQL


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: cheap cache keys
class Statement:
    """One statement a session runs. Its template numbers its values ``{0}``, ``{1}``,
    ``{2}``; an adapter fills them with literals or with its driver's placeholders.

    Attributes:
        what: the operation, as error messages name it (``"try_lock"``, ...).
        template: the SQL; the last column is always ``pg_backend_pid()``.
    """

    what: str
    template: str

    @functools.cached_property
    def arity(self) -> int:
        """How many values the template takes (``{0}`` ... ``{n}``)."""
        fields = [int(name) for _, name, _, _ in string.Formatter().parse(self.template)
                  if name is not None and name.isdigit()]  # fmt: skip
        return max(fields, default=-1) + 1

    def sql(self, *values: object) -> str:
        """The statement text with ``values`` in place of ``{0}``, ``{1}``, ...

        Args:
            *values: literals (integers only: they are not quoted) or placeholders
                such as ``"$1"``.

        Returns:
            The SQL to send.
        """
        return self.template.format(*values)


# Every statement ends with the session's token and its backend's pid, both checked by
# the session (a pooler that moved the statement, or another client that set up on the
# same server backend, is refused). Keys are parenthesised: "-2147483648::int4" parses as
# -(2147483648::int4) and overflows.
_TAIL = ", current_setting('pgleaderlock.session', true), pg_backend_pid()"
# A lock statement changes nothing unless it runs on the session's own backend with the
# session's token set there ({2} the pid, {3} the token); behind a pooler ({4} = 1) it
# also refuses a lock the backend already holds: the session never asks twice, so that
# would be another client's (a re-entrant grant is how two leaders share one backend).
_OWN = (
    "WHEN pg_backend_pid() <> ({2})::int4"
    " OR current_setting('pgleaderlock.session', true) IS DISTINCT FROM ({3})::int8::text"
    " THEN NULL"
)
_HELD = (
    "WHEN ({4})::int4 = 1 AND EXISTS (SELECT 1 FROM pg_catalog.pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    " AND classid = ((({0})::int8 & 4294967295)::oid)"
    " AND objid = ((({1})::int8 & 4294967295)::oid) AND objsubid = 2)"
    " THEN NULL"
)
TRY_LOCK = Statement(
    "try_lock",
    f"SELECT CASE {_OWN} {_HELD} ELSE pg_try_advisory_lock(({{0}})::int4, ({{1}})::int4) END"
    + _TAIL,
)
"""``pg_try_advisory_lock(key1, key2)``; values: the two keys, the session's pid and
token, and 1 behind a pooler (else 0). NULL: refused (see ``BaseSession``)."""
UNLOCK = Statement(
    "unlock",
    f"SELECT CASE {_OWN} ELSE pg_advisory_unlock(({{0}})::int4, ({{1}})::int4) END" + _TAIL,
)
"""``pg_advisory_unlock(key1, key2)``; values: the two keys, the session's pid and token."""
# One round trip: the lock_timeout is local to this statement's implicit transaction and
# is set before pg_advisory_lock starts waiting (the target list runs left to right).
# The timeout is a value like the keys, so that a driver that prepares statements needs
# one for waits of any length. A timeout raises lock_not_available (SQLSTATE 55P03).
WAIT_LOCK = Statement(
    "wait_lock",
    f"SELECT CASE {_OWN} ELSE set_config('lock_timeout', ({{5}})::int4::text, true) END,"
    f" CASE {_OWN} {_HELD} ELSE pg_advisory_lock(({{0}})::int4, ({{1}})::int4)::text END" + _TAIL,
)
"""``pg_advisory_lock(key1, key2)`` under a ``lock_timeout``; values: the two keys, the
session's pid and token, 1 behind a pooler, and the timeout in ms
([`lock_timeout_ms`][pgleaderlock.backends.lock_timeout_ms])."""
# Two-int4 advisory locks show up in pg_locks as classid=key1, objid=key2, objsubid=2,
# both as oid (unsigned): negative keys are passed already converted by key_to_oid().
HOLDS = Statement(
    "health check",
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
    " AND classid = ({0})::int8::oid AND objid = ({1})::int8::oid AND objsubid = 2),"
    " pg_is_in_recovery()" + _TAIL,
)
"""Does this session hold the lock (``pg_locks``), and is its server still a primary?
Values: the two keys as oids. ``pg_locks`` scans the whole lock table and every
connection slot: its cost grows with ``max_connections`` and the locks held, which is
why the periodic probe is [`ALIVE`][pgleaderlock.backends.ALIVE]."""
ALIVE = Statement("health check", "SELECT true, pg_is_in_recovery()" + _TAIL)
"""The periodic probe: the session answers, on the same backend with its token (the
checks every statement gets), and the server is still a primary. On a dedicated session
that is enough: a session-level lock is freed only by an unlock of the session's own or
by the session's end, and a session that answers on the same backend has not ended. Its
cost does not depend on the lock table or ``max_connections``."""
IDENTIFY = Statement("session setup", "SELECT pg_is_in_recovery()" + _TAIL)
"""Who serves this session (is the server a standby, which backend runs it), checked."""
STATEMENTS = (TRY_LOCK, UNLOCK, WAIT_LOCK, HOLDS, ALIVE, IDENTIFY)


# ---------------------------------------------------------------- coordinated groups

# Many locks on one session (a Coordinator's shared session). Arrays of keys; each lock
# statement is guarded like the single ones (the session's backend and token).
_OWN_MANY = (
    "pg_backend_pid() = ({2})::int4"
    " AND current_setting('pgleaderlock.session', true) = ({3})::int8::text"
)
TRY_LOCK_MANY = Statement(
    "try_lock",
    "SELECT (SELECT array_agg(k.i) FROM unnest(({0})::int4[], ({1})::int4[])"
    f" WITH ORDINALITY AS k(k1, k2, i) WHERE CASE WHEN {_OWN_MANY}"
    " THEN pg_try_advisory_lock(k.k1, k.k2) ELSE false END)" + _TAIL,
)
"""``pg_try_advisory_lock`` for many keys; values: the keys' two arrays, the session's
pid and token. The value: the 1-based positions of the keys granted (or NULL)."""
UNLOCK_MANY = Statement(
    "unlock",
    "SELECT (SELECT count(*) FROM unnest(({0})::int4[], ({1})::int4[]) AS k(k1, k2)"
    f" WHERE CASE WHEN {_OWN_MANY} THEN pg_advisory_unlock(k.k1, k.k2) ELSE false END)" + _TAIL,
)
"""``pg_advisory_unlock`` for many keys; the value: how many were held."""
NOTIFY = Statement("notify", "SELECT pg_notify(({0})::text, ({1})::text)" + _TAIL)
"""``pg_notify(channel, payload)``."""


GROUP_SNAPSHOT = Statement(
    "group snapshot",
    "SELECT a.application_name, l.pid, l.classid::int8, l.objid::int8, l.granted"
    " FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 2"
    " UNION ALL SELECT a.application_name, a.pid, NULL, NULL, NULL"
    " FROM pg_catalog.pg_stat_activity a"
    " WHERE starts_with(a.application_name, ({0})::text)",
)
"""Every two-key advisory lock held or waited for, with its session's
``application_name`` and pid, and every session whose ``application_name`` starts with
the value (a row with NULL keys each). Rows: application name, pid, key1 and key2 as
unsigned oids, granted. ``pg_stat_activity`` and ``pg_locks`` are visible to every
role."""


def bump_terms_statement(table: TermTable) -> Statement:
    """[`bump_term_statement`][pgleaderlock.backends.base.bump_term_statement] for many
    keys at once (values: the keys' two arrays, the session's pid). Rows come back as
    arrays: key1s, key2s, terms."""
    timeline = "(('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8 << 32)"
    return Statement(
        "fencing term",
        "WITH durable AS (SELECT set_config('synchronous_commit', 'on', true)),"
        f" bumped AS (INSERT INTO {table.sql} AS t (key1, key2, term, holder, acquired_at)"
        f" SELECT k.k1, k.k2, {timeline} + 1, current_setting('application_name'), now()"
        " FROM unnest(({0})::int4[], ({1})::int4[]) AS k(k1, k2)"
        " WHERE pg_backend_pid() = ({2})::int4"
        " ON CONFLICT (key1, key2) DO UPDATE SET term = GREATEST(t.term + 1, EXCLUDED.term),"
        " holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at"
        " RETURNING key1, key2, term)"
        " SELECT (SELECT array_agg(key1) FROM bumped), (SELECT array_agg(key2) FROM bumped),"
        " (SELECT array_agg(term) FROM bumped), (SELECT count(*) FROM durable)" + _TAIL,
    )


# ---------------------------------------------------------------- fencing terms


def create_terms_statement(table: TermTable) -> Statement:
    """``CREATE TABLE IF NOT EXISTS`` for the fencing terms: one row per lock, keyed by
    its keys, with the holder's ``application_name`` and the acquisition time."""
    return Statement(
        "create fencing table",
        f"CREATE TABLE IF NOT EXISTS {table.sql} (key1 int4 NOT NULL, key2 int4 NOT NULL,"
        " term int8 NOT NULL, holder text, acquired_at timestamptz NOT NULL,"
        " PRIMARY KEY (key1, key2))",
    )


def bump_term_statement(table: TermTable) -> Statement:
    """Increment a lock's term, durably, on the session that holds the lock (values: the
    two keys and the session's pid). The new term is ``max(old + 1, timeline << 32 |
    1)``: strictly increasing, and never equal across two primaries on different
    timelines. The upsert needs the row's exclusive lock, so it waits for every fenced
    transaction of the old term (they hold the row ``FOR SHARE``) to end."""
    timeline = "(('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8 << 32)"
    return Statement(
        "fencing term",
        # Durable (synchronous_commit), and a backend whose client gave up on it while it
        # waited for the row (a bump past command_timeout_s: the session was dropped) stops
        # waiting within a second instead of keeping the lock and committing the bump.
        "WITH durable AS (SELECT set_config('synchronous_commit', 'on', true),"
        " (SELECT count(set_config(s.name, '1000', true))"
        " FROM (VALUES ('client_connection_check_interval')) AS s(name)"
        " WHERE current_setting(s.name, true) IS NOT NULL)),"
        f" bumped AS (INSERT INTO {table.sql} AS t (key1, key2, term, holder, acquired_at)"
        f" SELECT ({{0}})::int4, ({{1}})::int4, {timeline} + 1,"
        " current_setting('application_name'), now()"
        " WHERE pg_backend_pid() = ({2})::int4"
        " ON CONFLICT (key1, key2) DO UPDATE SET term = GREATEST(t.term + 1, EXCLUDED.term),"
        " holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at RETURNING term)"
        " SELECT (SELECT term FROM bumped), (SELECT count(*) FROM durable)" + _TAIL,
    )


DUPLICATE_TABLE = frozenset({"42P07", "23505"})
"""What a concurrent ``CREATE TABLE IF NOT EXISTS`` may raise on the loser of a race."""


def setup_statement(settings: Mapping[str, str] | None, application_name: str = "") -> Statement:
    """The session's first statement: it says who serves the session and sets the
    session's token (``pgleaderlock.session``) on that backend; with ``settings`` it
    also, on a direct connection to a primary, sets them and ``application_name`` for
    the whole session (``set_config(..., false)``, which a session-mode pooler accepts,
    unlike startup parameters; settings this server version does not know are skipped)
    and frees any advisory lock a connection taken over from a pool still holds.

    "Direct" means that ``pg_backend_pid()`` equals the pid the protocol reported:
    behind a pooler nothing is set or freed, since the server connection may be shared
    between clients; the core checks the pooler first and then has
    [`configure_statement`][pgleaderlock.backends.base.configure_statement] set them.

    Args:
        settings: setting name -> value, or ``None`` to set nothing but the token.
        application_name: the session's ``application_name``.

    Returns:
        The statement. Its values: the session's token, and the protocol's pid. Its row:
        (in recovery, the token, settings applied or NULL, token, pid).
    """
    token = "set_config('pgleaderlock.session', ({0})::int8::text, false)"
    if settings is None:
        return Statement("session setup", f"SELECT pg_is_in_recovery(), {token}, NULL" + _TAIL)
    direct = "pg_backend_pid() = ({1})::int4 AND NOT pg_is_in_recovery()"
    sql = (
        f"SELECT pg_is_in_recovery(), {token}, CASE WHEN {direct} THEN"
        f" {_settings_count(settings, application_name)}"
        " + (SELECT count(*) FROM (SELECT pg_advisory_unlock_all()) AS freed) END" + _TAIL
    )
    return Statement("session setup", sql)


def configure_statement(settings: Mapping[str, str], application_name: str) -> Statement:
    """Set ``settings`` and ``application_name`` for the whole session, only on the
    session's own backend (values: its pid and token): a pooler that moved the statement
    to another client's server connection gets none of them there.

    Args:
        settings: setting name -> value.
        application_name: the session's ``application_name``.

    Returns:
        The statement.
    """
    count = _settings_count(settings, application_name, own=True)
    return Statement("session setup", f"SELECT {count}" + _TAIL)


def _settings_count(settings: Mapping[str, str], application_name: str, own: bool = False) -> str:
    pairs = [*settings.items(), ("application_name", application_name)]
    rows = ", ".join(f"({_literal(name)}, {_literal(value)})" for name, value in pairs)
    where = "current_setting(s.name, true) IS NOT NULL"
    if own:
        where += (
            " AND pg_backend_pid() = ({0})::int4"
            " AND current_setting('pgleaderlock.session', true) = ({1})::int8::text"
        )
    return (
        "(SELECT count(set_config(s.name, s.value, false)) FROM (VALUES "
        + rows.replace("{", "{{").replace("}", "}}")
        + f") AS s(name, value) WHERE {where})"
    )


def _literal(text: str) -> str:
    """A SQL string literal (standard_conforming_strings: only quotes need doubling)."""
    if "\x00" in text:
        raise ValueError("a setting cannot contain a NUL character")
    return "'" + text.replace("'", "''") + "'"


LOCK_NOT_AVAILABLE = "55P03"
"""The SQLSTATE of a ``lock_timeout`` that ended a
[`WAIT_LOCK`][pgleaderlock.backends.WAIT_LOCK]."""

CANCEL_TIMEOUT_S = 1.0
"""How long an interrupted lock wait may spend asking the server to cancel it (so the
queued backend leaves the queue at once) before the connection is simply dropped."""


def lock_timeout_ms(timeout_s: float) -> int:
    """``lock_timeout`` in ms for a wait of ``timeout_s``; never 0 (0 disables it).

    Args:
        timeout_s: how long the wait may last, in seconds.

    Returns:
        Whole milliseconds, at least 1.
    """
    return max(1, round(timeout_s * 1000))


# ---------------------------------------------------------------- errors

CONNECTION_SQLSTATE_CLASSES = frozenset(
    {"08", "27", "28", "2F", "38", "39", "3B", "40", "53", "54", "55", "57", "58", "F", "H"}
)
"""SQLSTATE classes (two characters, or one for ``F…``/``H…``) that mean "this session
is unusable, or never was": the classes psycopg raises as ``OperationalError``. A
backend that maps them to [`ConnectionError`][pgleaderlock.ConnectionError] and other server
errors to [`LockError`][pgleaderlock.LockError] gives the same library error as every other
backend for the same server error."""

_POOLER = (
    "a transaction-mode pooler (e.g. PgBouncer pool_mode=transaction) sits between this "
    "client and PostgreSQL. Session-level advisory locks need a direct connection or a "
    "session-mode pooler"
)


REFUSED_SQLSTATES: dict[str, ErrorClass] = {
    "28": ServerRefusedError,  # invalid_authorization_specification, invalid_password
    "3D000": ServerRefusedError,  # invalid_catalog_name: the database does not exist
    "42501": ServerRefusedError,  # insufficient_privilege: no CONNECT on the database
}
"""SQLSTATEs that mean the server refused this client at connect time for a reason
that retrying does not mend (a driver's connect may look them up with
[`by_sqlstate`][pgleaderlock.backends.base.by_sqlstate])."""

_REFUSED = re.compile(
    r"password authentication failed|authentication failed for user"
    r"|role \S+ does not exist|database \S+ does not exist|no pg_hba\.conf entry"
    r"|is not permitted to log in|permission denied for database|no password supplied"
)


_MISCONFIGURED = re.compile(
    r"invalid \S+ value|invalid connection option|invalid integer value|invalid port number"
)


def misconfigured_by_message(message: str) -> bool:
    """For libpq's connect errors: does the message say that a connection option is
    wrong (``invalid sslmode value``, ``invalid connection option``)? That is the
    client's configuration, which retrying does not mend."""
    return _MISCONFIGURED.search(message) is not None


def refused_by_message(message: str) -> bool:
    """For drivers whose connect errors carry no SQLSTATE (libpq's): does the message say
    that the server refused this client for good (see ``REFUSED_SQLSTATES``)? Only the
    server's English messages are recognised; others are treated as retryable."""
    return _REFUSED.search(message) is not None


def check_target_session_attrs(value: object, dsn: str) -> None:
    """Refuse a ``target_session_attrs`` that would let the lock settle on a standby.

    Args:
        value: the DSN's ``target_session_attrs``, or ``None``.
        dsn: the DSN, passwords masked, for the message.

    Raises:
        ConfigurationError: anything but ``read-write`` or ``primary``.
    """
    if value is not None and str(value) not in ("read-write", "primary"):
        raise ConfigurationError(
            f"target_session_attrs={value} in {dsn!r}: a lock must live on the primary "
            "(a standby's advisory locks do not exclude the primary's); use read-write, "
            "or leave it out (it is added for a multi-host DSN)"
        )


def sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE a driver error carries (psycopg and asyncpg both call it
    ``sqlstate``), or ``None``.

    Args:
        exc: a driver error, or anything else.

    Returns:
        The five-character code, or ``None`` for an error the server did not send.
    """
    code = getattr(exc, "sqlstate", None)
    return code if isinstance(code, str) and code else None


def by_sqlstate(code: str, table: Mapping[str, ErrorClass], default: ErrorClass) -> ErrorClass:
    """Look a SQLSTATE up in a driver's error table: the full code first, then its class
    (two characters), then its first character.

    Args:
        code: the SQLSTATE.
        table: SQLSTATE, class or first character -> library error.
        default: the library error when nothing matches.

    Returns:
        The library error class.
    """
    return table.get(code) or table.get(code[:2]) or table.get(code[:1]) or default


def translate(exc: BaseException, what: str, cls: ErrorClass) -> PgLeaderLockError:
    """The library error ``cls`` for the driver error ``exc``: the shared wording
    (``"<what>: <DriverError>: <first line of its message>"``, any DSN password
    masked), with ``exc`` as the ``__cause__``.

    Args:
        exc: the error the driver raised.
        what: the operation, for the message (``"try_lock"``, ``"connect"``, ...).
        cls: the library error to raise, as the driver's table says.

    Returns:
        The error to raise (``raise translate(...) from exc``).
    """
    text = str(exc).strip()
    message = mask_dsn(text.splitlines()[0] if text else repr(exc))
    if isinstance(exc, TimeoutError) and not text:
        message = "timed out"
    wording = f"{what}: {type(exc).__name__}: {message}"
    if issubclass(cls, SessionNotDedicatedError):
        # A statement of this session's own (a prepared one) is missing, or its name is
        # taken, on the server backend that ran it: another backend than the session's.
        wording += (
            ": the session's prepared statements are not on the server backend that ran "
            f"this one, so {_POOLER}"
        )
    err = cls(wording)
    err.__cause__ = exc
    return err


def check_pid(expected: int | None, got: int) -> None:
    """Raise if the statement ran on another server backend than the session's own.

    Args:
        expected: the session's server pid so far (``None`` before its first statement).
        got: the ``pg_backend_pid()`` the statement returned.

    Raises:
        SessionNotDedicatedError: the two differ.
    """
    if expected is not None and got != expected:
        raise SessionNotDedicatedError(
            f"the session moved from server backend {expected} to {got} between "
            f"statements: {_POOLER}"
        )


# ---------------------------------------------------------------- the session


_KNOWN_TABLES: set[TermTable] = set()
_SESSION_TOKENS = random.SystemRandom()


@functools.cache
def _bump_statement(table: TermTable) -> Statement:
    return bump_term_statement(table)


@functools.cache
def _bump_many_statement(table: TermTable) -> Statement:
    return bump_terms_statement(table)


_TCP_INFO_LEN = 104
_UNACKED_OFFSET = 24  # struct tcp_info: 8 bytes of u8 fields, then u32 rto, ato, snd_mss,
# rcv_mss, unacked (Linux include/uapi/linux/tcp.h)


def tcp_acknowledged(fd: int) -> bool | None:
    """Has the peer acknowledged every byte sent on this socket?

    True for a unix socket (there is no network to lose), ``None`` where TCP_INFO is
    not available (not Linux, or not a socket).

    Args:
        fd: the socket's file descriptor (left open).

    Returns:
        Whether the server's kernel has received all we sent.
    """
    if fd < 0:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family == socket.AF_UNIX:
            return True
        tcp_info = getattr(socket, "TCP_INFO", None)
        if tcp_info is None:
            return None
        info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, _TCP_INFO_LEN)
        if len(info) < _UNACKED_OFFSET + 4:
            return None
        (unacked,) = struct.unpack_from("I", info, _UNACKED_OFFSET)
        return bool(unacked == 0)
    except OSError:
        return None
    finally:
        sock.detach()  # the driver owns the descriptor


class BaseSession(abc.ABC):
    """A [`LockSession`][pgleaderlock.LockSession] with every optional capability
    (``wait_lock``, ``watch``, ``abort``), written once over a few driver calls.

    A subclass implements:

    - `_fetch`: run a [`Statement`][pgleaderlock.backends.Statement] with its values and
      return its row; when the call is cancelled, drop the connection without a network wait
      (and, for [`WAIT_LOCK`][pgleaderlock.backends.WAIT_LOCK], first ask the server to
      cancel it, within [`CANCEL_TIMEOUT_S`][pgleaderlock.backends.CANCEL_TIMEOUT_S]) and
      re-raise.
    - `_classify`: the library error a driver error stands for.
    - `_closed`, `_abort`, `_close`: the connection's state and how to drop it (at once) or
      close it (bounded).
    - optionally `_arm` and `_disarm`: start and stop listening for the server ending the
      idle session; `_fire` is the listener.

    Every statement's row is checked here (the value first, ``pg_backend_pid()`` last) and
    so is the pid ([`check_pid`][pgleaderlock.backends.check_pid]); driver errors are
    translated with [`translate`][pgleaderlock.backends.translate].
    """

    def __init__(self) -> None:
        self._pid: int | None = None
        self._watch: Callable[[], None] | None = None
        self._info: SessionInfo | None = None
        self._token = _SESSION_TOKENS.getrandbits(62) + 1  # marks the session's backend
        self._configured = False  # the lock's settings are applied
        self._held = False  # a lock call granted the lock (and no unlock since)
        self._verified = False  # held, and a pg_locks probe since the grant said so

    @property
    def backend_pid(self) -> int | None:
        """The server process id of this session, or ``None`` before its first statement."""
        return self._pid

    # ------------------------------------------------ for the subclass to implement

    @abc.abstractmethod
    async def _fetch(self, statement: Statement, values: tuple[Any, ...]) -> object:
        """Run ``statement`` with ``values`` (integers; also lists of integers and
        strings, for the coordinator's statements) and return its one row (a tuple), or
        ``None``; let driver errors propagate."""

    async def _fetch_all(self, statement: Statement, values: tuple[Any, ...]) -> list[Any]:
        """Run ``statement`` and return all its rows (tuples); for the coordinator's
        snapshots. Adapters that serve a Coordinator implement it."""
        raise ConnectionError(f"{type(self).__name__} cannot fetch several rows")

    async def _listen(self, channel: str) -> None:
        """``LISTEN channel``; for the coordinator. Adapters that serve a Coordinator
        implement it and `_receive`."""
        raise ConnectionError(f"{type(self).__name__} cannot listen for notifications")

    async def _receive(self, timeout_s: float) -> list[str]:
        """The payloads of the notifications received, waiting up to ``timeout_s`` for
        the first; raises once the connection is lost."""
        raise ConnectionError(f"{type(self).__name__} cannot listen for notifications")

    @abc.abstractmethod
    def _classify(self, exc: Exception) -> ErrorClass | None:
        """The library error a driver error stands for, or ``None`` for an error that is
        not the driver's (it propagates unchanged)."""

    @abc.abstractmethod
    def _closed(self) -> bool:
        """Is the connection known to be closed?"""

    @abc.abstractmethod
    def _protocol_pid(self) -> int | None:
        """The process id the protocol reported at connect (BackendKeyData)."""

    @abc.abstractmethod
    async def _reset(self) -> None:
        """Roll back an open transaction and switch to autocommit, if needed."""

    @abc.abstractmethod
    async def _execute_ddl(self, sql: str) -> None:
        """Run one statement without a result (``CREATE TABLE``)."""

    @abc.abstractmethod
    def _abort(self) -> None:
        """Drop the connection now, with no network wait (may raise: ignored)."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Close the connection, bounded even on a stuck network (may raise: ignored)."""

    def _socket(self) -> int:
        """The connection's socket descriptor, or -1 when not known (then
        ``acknowledged()`` cannot tell)."""
        return -1

    def acknowledged(self) -> bool | None:
        """Has the server acknowledged everything this session sent (TCP)? A probe that
        is late on a session whose bytes the server has acknowledged is slow, not lost:
        the path to the server works, so the server will not drop the session for
        silence. ``None`` when this cannot be told."""
        return tcp_acknowledged(self._socket())

    def _arm(self) -> None:  # noqa: B027 - optional: without it a loss waits for a probe
        """Have `_fire` called once the server ends the idle session. Does nothing
        here: a session that cannot tell learns of the loss at its next probe."""

    def _disarm(self) -> None:  # noqa: B027 - the counterpart of _arm
        """Undo `_arm` (may raise: ignored)."""

    # ------------------------------------------------ the LockSession

    async def _row(self, statement: Statement, values: tuple[Any, ...]) -> tuple[object, ...]:
        """Run ``statement``; return its row after checking its last two columns: the
        session's token and its backend's pid."""
        if self._watch is not None:
            self.watch(None)  # never compete with the driver for the connection
        try:
            row = await self._fetch(statement, values[: statement.arity])
        except Exception as exc:
            cls = self._classify(exc)
            if cls is None:
                raise
            raise translate(exc, statement.what, cls) from exc
        if not isinstance(row, tuple) or len(row) < 3 or not isinstance(row[-1], int):
            raise ConnectionError(f"{statement.what}: unexpected result {row!r}")
        pid = row[-1]
        if pid != self._pid:
            check_pid(self._pid, pid)
            self._pid = pid
        if self._info is not None and row[-2] != str(self._token):
            raise SessionNotDedicatedError(
                f"{statement.what}: another client set up on this session's server backend "
                f"({pid}): a pooler in transaction or statement mode shares it. "
                "Session-level advisory locks need a direct connection or a session-mode "
                "pooler"
            )
        return row

    async def _lock_call(self, statement: Statement, *values: int) -> object:
        """A lock statement, guarded: it runs only on the session's own backend, with
        its token (the session identifies itself first if it has not yet)."""
        info = self._info or await self.identify()
        pooled = int(info.behind_pooler)
        value = (await self._row(statement, (*values, info.backend_pid, self._token, pooled)))[0]
        if value is None and statement is not UNLOCK:
            raise SessionNotDedicatedError(
                f"{statement.what}: this session's server backend ({info.backend_pid}) "
                "already holds the lock it asked for: another client shares the backend "
                "(a pooler in transaction or statement mode)"
            )
        return value

    async def _lock_call_wait(self, key1: int, key2: int, timeout_ms: int) -> object:
        info = self._info or await self.identify()
        pooled = int(info.behind_pooler)
        values = (key1, key2, info.backend_pid, self._token, pooled, timeout_ms)
        row = await self._row(WAIT_LOCK, values)
        if row[1] is None:
            raise SessionNotDedicatedError(
                f"wait_lock: this session's server backend ({info.backend_pid}) already "
                "holds the lock it asked for: another client shares the backend (a pooler "
                "in transaction or statement mode)"
            )
        return row[1]

    async def identify(self, options: ConnectOptions | None = None) -> SessionInfo:
        """Roll back an open transaction, switch to autocommit, set the session's token
        on its backend and ask who serves it (``SetupSession``); run once, later calls
        return the same answer.

        With ``options``, a direct session to a primary also gets its settings in the
        same round trip (``configure()`` then has nothing left to do).
        """
        if self._info is None:
            try:
                await self._reset()
            except Exception as exc:
                cls = self._classify(exc)
                if cls is None:
                    raise
                raise translate(exc, IDENTIFY.what, cls) from exc
            protocol_pid = self._protocol_pid()
            if options is None or protocol_pid is None:
                statement = setup_statement(None)
            else:
                statement = setup_statement(options.server_settings, options.application_name)
            row = await self._row(statement, (self._token, protocol_pid or -1))
            self._configured = row[2] is not None
            assert self._pid is not None
            self._info = SessionInfo(self._pid, protocol_pid, bool(row[0]))
        return self._info

    async def backend_now(self) -> int:
        """Ask for the backend again, checked like every statement (``SetupSession``)."""
        await self.identify()
        await self._row(IDENTIFY, ())
        assert self._pid is not None
        return self._pid

    async def configure(self, options: ConnectOptions) -> None:
        """Apply the lock's session settings and ``application_name`` for the whole
        session (``SetupSession``), unless ``identify()`` did. Behind a pooler (which the
        core has accepted as session mode by then) no advisory lock is freed: the
        pooler reset the server connection when its last client left."""
        if self._configured:
            return
        info = await self.identify()
        statement = configure_statement(options.server_settings, options.application_name)
        await self._row(statement, (info.backend_pid, self._token))
        self._configured = True

    async def _create_terms(self, table: TermTable) -> None:
        """Create the table of fencing terms the first time this process meets it."""
        if table not in _KNOWN_TABLES:
            await self.run_ddl(create_terms_statement(table).template)
            _KNOWN_TABLES.add(table)

    async def run_ddl(self, sql: str) -> None:
        """Run a ``CREATE ... IF NOT EXISTS``; losing a race with another creator (which
        PostgreSQL may report as a duplicate) is fine."""
        if self._watch is not None:
            self.watch(None)
        try:
            await self._execute_ddl(sql)
        except Exception as exc:
            cls = self._classify(exc)
            if cls is None:
                raise
            if sqlstate(exc) not in DUPLICATE_TABLE:
                raise translate(exc, "create table", cls) from exc

    async def bump_term(self, table: TermTable, key1: int, key2: int) -> int:
        """Increment the lock's fencing term (``FencingSession``); the table is created
        the first time a session of this process meets it."""
        await self._create_terms(table)
        term = await self._lock_call(_bump_statement(table), key1, key2)
        if not isinstance(term, int):
            raise ConnectionError(f"fencing term: unexpected result {term!r}")
        return term

    # ------------------------------------------------ many locks (GroupSession)

    async def try_lock_many(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``pg_try_advisory_lock`` for each of ``keys``: those granted now."""
        if not keys:
            return []
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        row = await self._row(TRY_LOCK_MANY, (firsts, seconds, info.backend_pid, self._token))
        positions = cast(list[int] | None, row[0]) or []
        if positions:  # the next probe checks pg_locks once (see holds)
            self._held, self._verified = True, False
        return [keys[i - 1] for i in positions]

    async def unlock_many(self, keys: list[tuple[int, int]]) -> int:
        """``pg_advisory_unlock`` for each of ``keys``: how many this session held."""
        if not keys:
            return 0
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        row = await self._row(UNLOCK_MANY, (firsts, seconds, info.backend_pid, self._token))
        return int(cast(int, row[0]))

    async def bump_terms(
        self, table: TermTable, keys: list[tuple[int, int]]
    ) -> dict[tuple[int, int], int]:
        """Increment the fencing terms of ``keys`` (held by this session): key -> term."""
        if not keys:
            return {}
        await self._create_terms(table)
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        row = await self._row(_bump_many_statement(table), (firsts, seconds, info.backend_pid))
        k1s, k2s, terms = (cast(list[int] | None, value) or [] for value in row[:3])
        return {(a, b): t for a, b, t in zip(k1s, k2s, terms, strict=True)}

    async def group_snapshot(self, prefix: str) -> list[Any]:
        """The sessions named ``prefix...`` and every two-key advisory lock (see
        [`GROUP_SNAPSHOT`][pgleaderlock.backends.base.GROUP_SNAPSHOT])."""
        rows: list[Any] = await self._translated(
            GROUP_SNAPSHOT.what, self._fetch_all(GROUP_SNAPSHOT, (prefix,))
        )
        return rows

    async def notify(self, channel: str, payload: str) -> None:
        """``pg_notify(channel, payload)``."""
        await self._row(NOTIFY, (channel, payload))

    async def listen(self, channel: str) -> None:
        """``LISTEN channel``: from now on `notifications` returns its payloads."""
        await self._translated("listen", self._listen(channel))

    async def notifications(self, timeout_s: float) -> list[str]:
        """The payloads received on the channels listened to: those already in, or
        else the first to come within ``timeout_s`` (an empty list if none). Raises
        once the session is lost."""
        payloads: list[str] = await self._translated("listen", self._receive(timeout_s))
        return payloads

    async def ping(self) -> None:
        """Check that the session answers, on its own backend
        ([`ALIVE`][pgleaderlock.backends.ALIVE])."""
        await self._row(ALIVE, ())

    async def _translated(self, what: str, call: Awaitable[T]) -> T:
        if self._watch is not None:
            self.watch(None)
        try:
            return await call
        except Exception as exc:
            cls = self._classify(exc)
            if cls is None:
                raise
            raise translate(exc, what, cls) from exc

    async def try_lock(self, key1: int, key2: int) -> bool:
        """``pg_try_advisory_lock(key1, key2)``: True if granted now."""
        granted = bool(await self._lock_call(TRY_LOCK, key1, key2))
        if granted:
            self._held, self._verified = True, False
        return granted

    async def unlock(self, key1: int, key2: int) -> bool:
        """``pg_advisory_unlock(key1, key2)``: True if this session held the lock."""
        self._held = self._verified = False
        return bool(await self._lock_call(UNLOCK, key1, key2))

    async def holds(self, key1: int, key2: int) -> bool:
        """Does this session still hold the lock? Raises if it is dead, and
        [`StandbyError`][pgleaderlock.StandbyError] if its server became a standby.

        The first probe after the lock was granted asks ``pg_locks``
        ([`HOLDS`][pgleaderlock.backends.HOLDS]): it checks once per leadership that
        the lock really stays with the session (a pooler that resets server connections
        after every transaction would free it). Later probes only check that the session
        answers on the same backend ([`ALIVE`][pgleaderlock.backends.ALIVE]), which costs
        the server the same whatever the size of its lock table. A session that does not
        know itself to hold the lock always asks ``pg_locks``.
        """
        if self._verified:
            held, in_recovery, *_ = await self._row(ALIVE, ())
        else:
            row = await self._row(HOLDS, (key_to_oid(key1), key_to_oid(key2)))
            held, in_recovery, *_ = row
            self._verified = bool(held) and self._held
        if in_recovery:
            raise StandbyError("health check: the server is now a standby (in recovery)")
        return bool(held)

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        """Wait on the server for the lock: True once granted, False after ``timeout_s``
        (a ``lock_not_available`` error on a live session)."""
        try:
            await self._lock_call_wait(key1, key2, lock_timeout_ms(timeout_s))
        except PgLeaderLockError as exc:
            if sqlstate(exc.__cause__) == LOCK_NOT_AVAILABLE and not self._closed():
                return False  # lock_timeout: the wait ended without the lock
            raise
        self._held, self._verified = True, False
        return True

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once when the server ends the idle session; ``None`` removes
        the watch. On a session already closed it is called soon, from the event loop."""
        if self._watch is not None:
            self._watch = None
            with contextlib.suppress(Exception):
                self._disarm()
        if callback is None:
            return
        self._watch = callback
        if self._closed():
            asyncio.get_running_loop().call_soon(self._fire)
        else:
            self._arm()

    def _fire(self, *_: object) -> None:
        callback = self._watch
        if callback is not None:
            self.watch(None)
            callback()

    def abort(self) -> None:
        """Drop the connection at once, with no network wait. Idempotent, never raises."""
        self.watch(None)
        with contextlib.suppress(Exception):
            self._abort()

    async def close(self) -> None:
        """Close the session (which frees its locks). Idempotent, bounded, never raises."""
        self.watch(None)
        with contextlib.suppress(Exception):
            await self._close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend_pid={self._pid} closed={self._closed()}>"
