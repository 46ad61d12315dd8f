"""What every built-in adapter shares: the session's calls, the row and pid checks.

An adapter subclasses [`BaseSession`][pgleaderlock.backends.BaseSession] and writes only
driver calls: how to run one of the four statements (``_fetch``), how to close the
connection, how to watch its socket, and which library error a driver error stands for
(``_classify``, usually one lookup in a table). ``try_lock``, ``unlock``, ``holds``,
``wait_lock``, ``watch``, ``abort`` and ``close`` are written once, here.

Every statement also returns ``pg_backend_pid()``: a session whose server backend
changes between statements is behind a transaction-mode pooler, where a session-level
advisory lock is held by whichever server connection ran the statement. Such a session
is refused ([`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError]).

The SQL lives in ``pgleaderlock.backends.sql``, the error translation in
``pgleaderlock.backends.errors``; this module re-exports both. It imports no driver. A
third-party backend may build on it (import it as ``pgleaderlock.backends.base``, or the
same names from ``pgleaderlock.backends``), or use only the statements and
[`translate`][pgleaderlock.backends.translate].
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import math
import random
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar, cast

from ..core.errors import (
    ConnectionError,
    MissingPrivilegeError,
    PgLeaderLockError,
    SessionNotDedicatedError,
    StandbyError,
    UnclaimedGrantError,
)
from ..core.keys import key_to_oid
from ..core.session import ConnectOptions, FencedSessions, SessionInfo
from ..core.tables import LibraryTable, TableCheck, TermTable
from .errors import (
    CONNECTION_SQLSTATE_CLASSES,
    REFUSED_SQLSTATES,
    ErrorClass,
    by_sqlstate,
    check_pid,
    check_target_session_attrs,
    misconfigured_by_message,
    refused_by_message,
    sqlstate,
    translate,
)
from .sql import (
    ALIVE,
    CANCEL_TIMEOUT_S,
    CLAIM,
    DUPLICATE_TABLE,
    FLUSH_STATS,
    FORGET,
    GROUP_SNAPSHOT,
    HOLDS,
    IDENTIFY,
    LOCK_NOT_AVAILABLE,
    NOTIFY,
    STATEMENTS,
    TABLE_CHECK,
    TRY_LOCK,
    TRY_LOCK_MANY,
    UNLOCK,
    UNLOCK_MANY,
    WAIT_LOCK,
    Statement,
    _bump_many_statement,
    _bump_statement,
    _end_fenced_statement,
    bump_term_statement,
    bump_terms_statement,
    configure_statement,
    create_terms_statement,
    lock_timeout_ms,
    setup_statement,
)

T = TypeVar("T")

__all__ = [
    "ALIVE",
    "CANCEL_TIMEOUT_S",
    "CLAIM",
    "CONNECTION_SQLSTATE_CLASSES",
    "DUPLICATE_TABLE",
    "GROUP_SNAPSHOT",
    "HOLDS",
    "IDENTIFY",
    "LOCK_NOT_AVAILABLE",
    "NOTIFY",
    "REFUSED_SQLSTATES",
    "STATEMENTS",
    "TRY_LOCK",
    "TRY_LOCK_MANY",
    "UNLOCK",
    "UNLOCK_MANY",
    "WAIT_LOCK",
    "BaseSession",
    "ErrorClass",
    "Statement",
    "bump_term_statement",
    "bump_terms_statement",
    "by_sqlstate",
    "check_pid",
    "check_target_session_attrs",
    "configure_statement",
    "create_terms_statement",
    "lock_timeout_ms",
    "misconfigured_by_message",
    "refused_by_message",
    "setup_statement",
    "sqlstate",
    "tcp_acknowledged",
    "translate",
]


# ---------------------------------------------------------------- the session


_SESSION_TOKENS = random.SystemRandom()


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
    with _borrowed(fd) as sock:
        if sock is None:
            return None
        if sock.family == socket.AF_UNIX:
            return True
        tcp_info = getattr(socket, "TCP_INFO", None)
        if tcp_info is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, _TCP_INFO_LEN)
        except OSError:
            return None
        if len(info) < _UNACKED_OFFSET + 4:
            return None
        (unacked,) = struct.unpack_from("I", info, _UNACKED_OFFSET)
        return bool(unacked == 0)


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """The driver's socket ``fd`` as a socket object (None if it is not one), left open
    for the driver, which owns the descriptor."""
    try:
        sock = socket.socket(fileno=fd) if fd >= 0 else None
    except OSError:
        sock = None
    try:
        yield sock
    finally:
        if sock is not None:
            sock.detach()


def set_keepalive(fd: int, idle_s: int, interval_s: int, count: int) -> bool:
    """Turn on TCP keepalives on a socket: a silent peer (a partition, a dead host) is
    noticed after about ``idle_s + interval_s * count`` seconds without traffic.

    Args:
        fd: the socket's file descriptor (left open).

    Returns:
        True once set, and for a unix socket (there is no network to lose); False when
        they cannot be set here (not a socket, or an OS without the options).
    """
    with _borrowed(fd) as sock:
        if sock is None:
            return False
        if sock.family == socket.AF_UNIX:
            return True
        options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s),
                            ("TCP_KEEPCNT", count)):  # fmt: skip
            option = getattr(socket, name, None)
            if option is None:
                return False
            options.append((socket.IPPROTO_TCP, option, value))
        try:
            for level, option, value in options:
                sock.setsockopt(level, option, value)
        except OSError:
            return False
        return True


# A follower's wait outlives the call that started it (see BaseSession.wait_lock); its
# TCP session is kept honest by keepalives: a partition is noticed within about 10 s.
_WAIT_KEEPALIVE = (5, 1, 5)


_NOW_A_STANDBY = "health check: the server is now a standby (in recovery)"


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
        self._unsure = False  # the last wait timed out: it may have been granted meanwhile
        # A wait on the server that outlives wait_lock() calls (see there), and its keys.
        self._waiting: asyncio.Task[object] | None = None
        self._waiting_for: tuple[int, int] | None = None
        self._can_wait_on: bool | None = None  # may waits outlive the calls? (known once)
        self._lease_ms = 0  # set by the lock calls once they grant a lock (configure())
        self._claim_ms = 0  # set by a wait as it is granted, until claimed (configure())

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

    async def _receive(self, timeout_s: float) -> list[tuple[int, str]]:
        """The notifications received (sender pid, payload), waiting up to
        ``timeout_s`` for the first; raises once the connection is lost."""
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

    def fileno(self) -> int:
        """The connection's socket descriptor, or -1 (see
        [`SocketSession`][pgleaderlock.backends.SocketSession])."""
        return self._socket()

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
        if self._waiting is not None and statement is not WAIT_LOCK and statement is not CLAIM:
            await self._drop_wait(statement.what)
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

    @property
    def _mode(self) -> int:
        """The lock statements' ``{4}``: 2 after a wait that timed out, 1 behind a
        pooler, else 0."""
        if self._unsure:
            return 2
        return int(self._info is not None and self._info.behind_pooler)

    async def _lock_call(self, statement: Statement, *values: int) -> object:
        """A lock statement, guarded: it runs only on the session's own backend, with
        its token (the session identifies itself first if it has not yet)."""
        info = self._info or await self.identify()
        values = (*values, info.backend_pid, self._token, self._mode, self._lease_ms)
        value = (await self._row(statement, values))[0]
        self._unsure = False
        if value is None and statement is not UNLOCK:
            raise SessionNotDedicatedError(
                f"{statement.what}: this session's server backend ({info.backend_pid}) "
                "already holds the lock it asked for: another client shares the backend "
                "(a pooler in transaction or statement mode)"
            )
        return value

    async def _lock_call_wait(self, key1: int, key2: int, timeout_ms: int) -> object:
        info = self._info or await self.identify()
        granted_ms = self._claim_ms or self._lease_ms  # the idle bound of a grant
        values = (key1, key2, info.backend_pid, self._token, self._mode, granted_ms, timeout_ms)
        row = await self._row(WAIT_LOCK, values)
        self._unsure = False
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
            self._info = SessionInfo(
                self._pid, protocol_pid, bool(row[0]), bool(row[3]), bool(row[4])
            )
        if options is not None:
            self._set_lease(options)
        return self._info

    def _set_lease(self, options: ConnectOptions) -> None:
        """The lease the lock calls set once they grant a lock, and the claim a wait
        sets as it is granted (neither where the server cannot hold one; no claim when
        it would not be shorter than the lease)."""
        supported = self._info is not None and self._info.lease_supported
        self._lease_ms = math.ceil(options.lease_s * 1000) if supported else 0
        claim_ms = math.ceil(options.claim_s * 1000) if supported and options.claim_s > 0 else 0
        if self._lease_ms and claim_ms >= self._lease_ms:
            claim_ms = 0
        self._claim_ms = claim_ms

    async def _claim(self) -> None:
        """A wait was granted the lock, and the session has read the grant: replace the
        claim's short idle bound by the lease ([`CLAIM`][pgleaderlock.backends.CLAIM]).
        Fails with [`UnclaimedGrantError`][pgleaderlock.UnclaimedGrantError] when the
        server ended the session meanwhile (the grant was not read within the claim's
        bound): the lock went to the next waiter."""
        if not self._claim_ms:
            return
        info = self._info or await self.identify()
        try:
            row = await self._abort_if_cut(CLAIM, (info.backend_pid, self._token, self._lease_ms))
        except SessionNotDedicatedError:
            raise
        except ConnectionError as exc:
            raise UnclaimedGrantError(
                f"wait_lock: the lock was granted, but the server ended the session before "
                f"this client claimed it (within {self._claim_ms / 1000:g} s): {exc}"
            ) from exc.__cause__
        if row[0] is None:
            raise SessionNotDedicatedError(
                f"claim: this session's server backend is not {info.backend_pid}: "
                "another client shares the backend (a pooler in transaction or "
                "statement mode)"
            )

    async def _abort_if_cut(
        self, statement: Statement, values: tuple[Any, ...]
    ) -> tuple[object, ...]:
        """`_row` for a statement that runs inside ``wait_lock`` (whose caller cuts it
        short without aborting the session first, so that the wait itself can be
        cancelled on the server): if cut short, the session is dropped at once, before
        the driver sees the cancellation (psycopg would ask the server to cancel a
        statement that has long finished, and wait for that, for seconds)."""
        task = asyncio.ensure_future(self._row(statement, values))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.abort()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise

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
        self._set_lease(options)
        if self._configured:
            return
        info = await self.identify()
        statement = configure_statement(options.server_settings, options.application_name)
        await self._row(statement, (info.backend_pid, self._token))
        self._configured = True

    async def prepare_table(self, table: LibraryTable) -> None:
        """Make sure this session may use ``table`` (``TableSession``): create it if it
        is missing and the role may (``table.create``), or make it again when the
        session's own role owns it and it is not as it must be (``table.unsafe``: the
        participants table's row-level security); then check that it is a plain table
        that a trusted role owns, in a schema a trusted role owns, that it is safe, and
        that the role has the privileges it needs. It checks at every call (the core
        calls it once per session).

        Raises:
            UntrustedObjectError: the table (or its schema) is another role's, or not a
                plain table: it is not used.
            MissingPrivilegeError: the role may not create it, or lacks a privilege on
                it; the message has the statement that mends it.
            ConfigurationError: the schema does not exist.
        """
        check = await self._check_table(table)
        if check.relkind is None and check.schema_owner is not None and check.schema_trusted:
            if not (check.schema_usage and check.schema_create):
                raise MissingPrivilegeError(check.cannot_create())
            await self.run_ddl(table.create)
            check = await self._check_table(table)
        elif check.owner == check.role and check.schema_trusted and table.unsafe(check):
            # The session's own table, made by an earlier version or changed since (its
            # row-level security): made as it must be again (``table.create`` is
            # idempotent), then checked again; what it cannot mend is refused below.
            await self.run_ddl(table.create)
            check = await self._check_table(table)
        check.verify()

    async def _check_table(self, table: LibraryTable) -> TableCheck:
        values = (table.schema, table.name, list(table.trusted_roles))
        row = await self._row(TABLE_CHECK, values)
        return TableCheck.of(table, row)

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

    async def bump_term(self, table: TermTable, key1: int, key2: int, wait_s: float) -> int | None:
        """Increment the lock's fencing term (``FencingSession``), waiting at most
        ``wait_s`` for fenced transactions of older terms (``None`` after that). The
        core has the table checked first (``prepare_table``)."""
        info = self._info or await self.identify()
        values = (key1, key2, info.backend_pid, lock_timeout_ms(wait_s))
        row = await self._bumped(table, _bump_statement(table), values)
        if row is None:
            return None
        if not isinstance(row[0], int):
            raise ConnectionError(f"fencing term: unexpected result {row[0]!r}")
        return row[0]

    async def _bumped(
        self, table: TermTable, statement: Statement, values: tuple[Any, ...]
    ) -> tuple[object, ...] | None:
        """Run a term bump: its row, or ``None`` when its wait for the term rows ended
        in ``lock_timeout``."""
        try:
            return await self._row(statement, values)
        except PgLeaderLockError as exc:
            if sqlstate(exc.__cause__) == LOCK_NOT_AVAILABLE and not self._closed():
                return None
            raise

    async def end_fenced(self, table: TermTable, keys: list[tuple[int, int]]) -> FencedSessions:
        """End the fenced transactions of older terms that hold the term rows of
        ``keys`` (``FencingSession``; see
        [`end_fenced_statement`][pgleaderlock.backends.sql.end_fenced_statement])."""
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        row = await self._row(_end_fenced_statement(table), (firsts, seconds))
        ended, refused, roles = (cast(list[Any] | None, value) or [] for value in row[:3])
        return FencedSessions(
            tuple(int(pid) for pid in ended),
            tuple((int(pid), str(role)) for pid, role in zip(refused, roles, strict=True)),
        )

    # ------------------------------------------------ many locks (GroupSession)

    async def try_lock_many(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``pg_try_advisory_lock`` for each of ``keys``: those granted now."""
        if not keys:
            return []
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        values = (firsts, seconds, info.backend_pid, self._token, self._lease_ms)
        row = await self._row(TRY_LOCK_MANY, values)
        positions = cast(list[int] | None, row[0]) or []
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
        self, table: TermTable, keys: list[tuple[int, int]], wait_s: float
    ) -> dict[tuple[int, int], int] | None:
        """Increment the fencing terms of ``keys`` (held by this session): key -> term;
        ``None`` when fenced transactions of older terms still hold a row after
        ``wait_s`` (no term changed)."""
        if not keys:
            return {}
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        values = (firsts, seconds, info.backend_pid, lock_timeout_ms(wait_s))
        row = await self._bumped(table, _bump_many_statement(table), values)
        if row is None:
            return None
        k1s, k2s, terms = (cast(list[int] | None, value) or [] for value in row[:3])
        return {(a, b): t for a, b, t in zip(k1s, k2s, terms, strict=True)}

    async def group_snapshot(self, prefix: str, trusted_roles: Sequence[str] = ()) -> list[Any]:
        """The sessions named ``prefix...`` and every two-key advisory lock, each with
        whether its role is trusted (see
        [`GROUP_SNAPSHOT`][pgleaderlock.backends.sql.GROUP_SNAPSHOT])."""
        values = (prefix, list(trusted_roles))
        rows: list[Any] = await self._translated(
            GROUP_SNAPSHOT.what, self._fetch_all(GROUP_SNAPSHOT, values)
        )
        return rows

    async def notify(self, channel: str, payload: str) -> None:
        """``pg_notify(channel, payload)``."""
        await self._row(NOTIFY, (channel, payload))

    async def listen(self, channel: str) -> None:
        """``LISTEN channel``: from now on `notifications` returns its payloads."""
        await self._translated("listen", self._listen(channel))

    async def notifications(self, timeout_s: float) -> list[tuple[int, str]]:
        """The notifications received on the channels listened to, as (the sending
        backend's pid, payload): those already in, or else the first to come within
        ``timeout_s`` (an empty list if none). Raises once the session is lost."""
        received: list[tuple[int, str]] = await self._translated("listen", self._receive(timeout_s))
        return received

    async def query(self, template: str, values: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """Every row of one of the library's statements (``QuerySession``; a schedule's
        ledger), run in autocommit on this session."""
        statement = _query_statement(template)
        rows = await self._translated(statement.what, self._fetch_all(statement, values))
        return [tuple(row) for row in rows]

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
        """``pg_try_advisory_lock(key1, key2)``: True if granted now (by the wait in
        flight for it, if there is one)."""
        if self._waiting is not None and self._waiting_for == (key1, key2):
            return await self.wait_lock(key1, key2, 0.0)
        return bool(await self._lock_call(TRY_LOCK, key1, key2))

    async def unlock(self, key1: int, key2: int) -> bool:
        """``pg_advisory_unlock(key1, key2)``: True if this session held the lock."""
        return bool(await self._lock_call(UNLOCK, key1, key2))

    async def holds(self, key1: int, key2: int) -> bool:
        """Does this session still hold the lock (``pg_locks``,
        [`HOLDS`][pgleaderlock.backends.HOLDS])? Raises if it is dead, and
        [`StandbyError`][pgleaderlock.StandbyError] if its server became a standby."""
        held, in_recovery, *_ = await self._row(HOLDS, (key_to_oid(key1), key_to_oid(key2)))
        if in_recovery:
            raise StandbyError(_NOW_A_STANDBY)
        return bool(held)

    def start_probe(self) -> asyncio.Future[None] | None:
        """The cheap probe as a future
        ([`ProbingSession`][pgleaderlock.backends.ProbingSession]): the adapter's quick
        probe if it has one, else the [`ALIVE`][pgleaderlock.backends.ALIVE] statement
        (the session answers on its own backend, with its token, on a primary) in a task
        of its own. On a session already closed, it fails with ``ConnectionError``."""
        probe = self._start_alive()
        if probe is None:
            probe = asyncio.get_running_loop().create_task(self._alive())
        return probe

    def keep_alive(self) -> asyncio.Future[None] | None:
        """Renew the session's lease, asking nothing (``KeepAliveSession``): the cheap
        probe (`start_probe`), whose answer nobody needs; ``None`` on a closed session."""
        return None if self._closed() else self.start_probe()

    async def _alive(self) -> None:
        """[`ALIVE`][pgleaderlock.backends.ALIVE]; raises on a standby."""
        _, in_recovery, *_ = await self._row(ALIVE, ())
        if in_recovery:
            raise StandbyError(_NOW_A_STANDBY)

    def _start_alive(self) -> asyncio.Future[None] | None:
        """Optional: a cheaper probe than [`ALIVE`][pgleaderlock.backends.ALIVE] that
        proves the same on a session checked at connect, started at once: a future that
        resolves when the session's own backend has answered on the session's socket,
        or fails with a translated error (the session then aborted). It must not raise,
        and must leave the watch (`watch`) armed. A backend cannot change hands or become
        a standby while its connection lives, so the token and recovery checks add
        nothing there. ``None``: not possible now (the statement is used). The psycopg
        adapter sends a bare protocol ``Sync``."""
        return None

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        """Wait on the server for the lock: True once granted, False after ``timeout_s``.

        On a direct connection to PostgreSQL 14 or later, the wait on the server goes on
        after this returns False: the next call for the same lock waits on, so that a
        follower waits in one piece, with no ``lock_timeout`` (whose every expiry
        writes an ERROR and the statement into the server's log) and no new place in
        the queue. Keepalives on the socket notice a partition meanwhile. Closing the
        session cancels the wait on the server; a wait whose client died without a word
        ends within a second (``client_connection_check_interval``, set when the session
        is set up, unless the server logs lock waits: see ``WAIT_SETTINGS``). Any other
        statement, or a wait for another lock, drops the session first
        (``ConnectionError``): the wait cannot be told apart from a grant in flight.
        Elsewhere (an older server, a pooler, a socket without keepalives) every call is
        one wait under a ``lock_timeout`` of ``timeout_s``.

        A grant sets the claim's short ``idle_session_timeout``
        (``ConnectOptions.claim_s``): the server may grant the lock while nobody reads
        the answer (this process stopped, its event loop blocked). The session claims
        the lock as soon as it reads the grant (the lease replaces the claim's bound),
        before this returns True; a session that reads it too late finds itself ended
        ([`UnclaimedGrantError`][pgleaderlock.UnclaimedGrantError]), and the lock with
        the next waiter.
        """
        if not self._waits_on():
            try:
                await self._lock_call_wait(key1, key2, lock_timeout_ms(timeout_s))
            except PgLeaderLockError as exc:
                if sqlstate(exc.__cause__) == LOCK_NOT_AVAILABLE and not self._closed():
                    self._unsure = True  # granted as the timeout fired? (see WAIT_LOCK)
                    return False  # lock_timeout: the wait ended without the lock
                raise
            await self._claim()
            return True
        wait = self._waiting
        if wait is not None and self._waiting_for != (key1, key2):
            await self._drop_wait("wait_lock")
        if wait is None:
            if self._info is not None and self._info.shared_stats:
                # no statistics timer to wake the wait
                await self._abort_if_cut(FLUSH_STATS, ())
            wait = self._waiting = asyncio.get_running_loop().create_task(
                self._wait_then_claim(key1, key2)
            )
            self._waiting_for = (key1, key2)
        try:
            done, _ = await asyncio.wait((wait,), timeout=max(0.0, timeout_s))
        except asyncio.CancelledError:  # the caller gives up: so does the server's wait
            await self._cancel_wait()
            self._unsure = True  # granted as the cancel arrived? (see WAIT_LOCK)
            raise
        if not done:
            return False  # still waiting on the server
        self._waiting = self._waiting_for = None
        wait.result()  # the wait's error, if it failed (or its claim's)
        return True

    async def _wait_then_claim(self, key1: int, key2: int) -> None:
        """The wait that outlives the calls (no ``lock_timeout``: until granted), then the
        claim, at once: the claim bounds a grant that this process cannot read (stopped,
        its event loop blocked), not one its caller reads late (its lease does)."""
        await self._lock_call_wait(key1, key2, 0)
        await self._claim()

    def _waits_on(self) -> bool:
        """May a wait outlive the calls (see `wait_lock`)? Decided once per session."""
        if self._can_wait_on is None:
            info = self._info
            direct = info is not None and info.lease_supported and not info.behind_pooler
            self._can_wait_on = direct and set_keepalive(self._socket(), *_WAIT_KEEPALIVE)
        return self._can_wait_on

    async def _cancel_wait(self) -> None:
        """Cancel the wait in flight, if any, and wait for it to end: the driver asks
        the server to cancel the statement (bounded by ``CANCEL_TIMEOUT_S``)."""
        wait, self._waiting, self._waiting_for = self._waiting, None, None
        if wait is not None:
            wait.cancel()
            await asyncio.gather(wait, return_exceptions=True)

    async def _drop_wait(self, what: str) -> NoReturn:
        """A wait is in flight on the session and something else was asked of it: drop
        the session (the wait's backend stops within a second) and say so."""
        try:
            await self._cancel_wait()
        finally:
            self.abort()
        raise ConnectionError(f"{what}: the session was waiting for a lock; it was dropped")

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once when the server ends the idle session; ``None`` removes
        the watch. On a session already closed it is called soon, from the event loop."""
        if callback is not None and self._watch is not None and not self._closed():
            self._watch = callback  # armed already: no need to come off the loop and back
            return
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
        try:
            await self._cancel_wait()
            if self._info is not None and self._info.behind_pooler and not self._closed():
                await self._forget()
        except BaseException:
            self.abort()  # cut short: the connection goes now, not with the garbage
            raise
        finally:
            with contextlib.suppress(Exception):
                await self._close()

    async def _forget(self) -> None:
        """Behind a pooler, take the session's token off the server backend before
        leaving: a pooled backend that another client gets next is left as it was found
        (a session-mode pooler's ``DISCARD ALL`` would do it; a transaction pooler, which
        a refused session is behind, runs nothing). Bounded; never raises."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                await self._fetch(FORGET, (self._token,))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend_pid={self._pid} closed={self._closed()}>"


@functools.lru_cache(maxsize=256)
def _query_statement(template: str) -> Statement:
    """One ``Statement`` per template, so that a driver that prepares statements
    (asyncpg) prepares each once per session."""
    return Statement("ledger", template)
