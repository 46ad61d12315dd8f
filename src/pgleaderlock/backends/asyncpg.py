"""The asyncpg backend: one dedicated ``asyncpg.Connection``, never one from a pool.

Driver calls only: the lock calls, the row and pid checks and the error wording are
[`BaseSession`][pgleaderlock.backends.BaseSession]'s. No retries, no timers: the core bounds
every call with a timeout and decides what a failure means.

Each session on a direct connection prepares its (at most four) statements once, with the
keys as parameters, and reuses them: one Bind/Execute round trip per call after the
first. The setup statement, and every statement behind a pooler, is prepared unnamed for
one call: a pooled server backend keeps no statement of a session that may not be its
own (a transaction pooler would hand it to other clients). Every statement also
returns ``pg_backend_pid()`` for the pooler check. asyncpg reads its socket all the time, so
`AsyncpgSession.watch` uses asyncpg's termination listener instead of watching the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import Any, cast
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

import asyncpg
import asyncpg.pool

from ..lowlevel import (
    ConfigurationError,
    ConnectionError,
    ConnectOptions,
    LockError,
    LockSession,
    PooledConnectionError,
    SessionNotDedicatedError,
)
from .base import (
    CANCEL_TIMEOUT_S,
    CONNECTION_SQLSTATE_CLASSES,
    REFUSED_SQLSTATES,
    WAIT_LOCK,
    BaseSession,
    ErrorClass,
    Statement,
    by_sqlstate,
    check_target_session_attrs,
    malformed_dsn,
    module_backend,
    sqlstate,
    translate,
)

__all__ = ["AsyncpgSession", "backend", "check_dsn", "connect", "wrap"]


# asyncpg's errors carry the server's SQLSTATE: SQLSTATE (or its class) -> library error
# for a server error on a live session; anything not listed is a LockError.
_ERRORS: dict[str, ErrorClass] = {
    **dict.fromkeys(CONNECTION_SQLSTATE_CLASSES, ConnectionError),
    # Our own prepared statement is missing, or its name is taken, on the server backend
    # that ran the statement: another backend than the one that prepared it, i.e. a
    # transaction-mode pooler (older PgBouncer fails this way before the pid check can).
    "26000": SessionNotDedicatedError,
    "42P05": SessionNotDedicatedError,
}


def _classify(exc: BaseException, conn: asyncpg.Connection | None = None) -> ErrorClass:
    """The library error for an asyncpg (or socket) error.

    A server error on a live session is looked up in ``_ERRORS``; anything else is a
    [`ConnectionError`][pgleaderlock.ConnectionError]. After ``pg_terminate_backend`` asyncpg may
    raise any of several types (``ConnectionDoesNotExistError``, ``InterfaceError``,
    ``InternalClientError``, ``AdminShutdownError``, ``OSError``): they all mean the
    session is gone.

    Args:
        exc: the error the driver raised.
        conn: the session's connection, if any: a closed one makes it a connection error.
    """
    code = sqlstate(exc) if isinstance(exc, asyncpg.PostgresError) else None
    if code is None:
        return ConnectionError
    cls = by_sqlstate(code, _ERRORS, LockError)
    if cls is LockError and (conn is None or conn.is_closed()):
        return ConnectionError
    return cls


def connect_error(exc: BaseException) -> Exception | None:
    """``_connect_error`` for asyncpg's own errors only (a ``connect_fn``'s)."""
    if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError):
        return _connect_error(exc)
    return None


def _connect_error(exc: BaseException) -> Exception:
    """A connect error: a bad connection parameter (asyncpg's client configuration, or a
    URL parameter the server does not know as a setting), refused for good
    (``REFUSED_SQLSTATES``), or a connection error."""
    if isinstance(exc, asyncpg.ClientConfigurationError) or sqlstate(exc) == "42704":
        return translate(exc, "connect", ConfigurationError)
    code = sqlstate(exc) if isinstance(exc, asyncpg.PostgresError) else None
    cls = by_sqlstate(code, REFUSED_SQLSTATES, ConnectionError) if code else ConnectionError
    return translate(exc, "connect", cls)


class AsyncpgSession(BaseSession):
    """A [`LockSession`][pgleaderlock.LockSession] over one ``asyncpg.Connection``.

    Args:
        conn: a dedicated connection; it must not come from an ``asyncpg.Pool``. An
            open transaction on it is rolled back before its first statement, so that
            the lock is session-level and the session is never idle in transaction.
    """

    def __init__(self, conn: asyncpg.Connection) -> None:
        super().__init__()
        self._conn = conn
        self._ready = False
        self._listener = self._fire  # one bound method: asyncpg compares them
        # The session's own prepared statements: a little faster per call than
        # conn.fetchrow(), which looks the statement up in asyncpg's cache each time.
        self._statements: dict[Statement, Any] = {}
        # Notifications (sender pid, payload); None: the connection is lost.
        self._inbox: asyncio.Queue[tuple[int, str] | None] | None = None

    @property
    def connection(self) -> asyncpg.Connection:
        """The underlying driver connection."""
        return self._conn

    async def _prepare(self, statement: Statement) -> Any:
        if not self._ready:
            await self._reset()
        sql = statement.sql(*[f"${n}" for n in range(1, max(statement.arity, 7) + 1)])
        info = self._info
        if info is None or info.behind_pooler:  # once, unnamed: nothing stays behind
            return await self._conn.prepare(sql, name="")
        prepared = self._statements[statement] = await self._conn.prepare(sql)
        return prepared

    async def _fetch(self, statement: Statement, values: tuple[Any, ...]) -> object:
        """Run ``statement`` as a prepared statement of the session's own.

        A cancelled call drops the connection at once: the core closes a session after
        any interrupted call anyway. (asyncpg answers the cancellation of a query by
        scheduling a cancel request over a new connection, and would not run another
        statement until the server acknowledged it, which a stuck network can delay
        indefinitely; terminate() withdraws that request before it goes out.)
        """
        conn = self._conn
        try:
            prepared = self._statements.get(statement)
            if prepared is None:
                prepared = await self._prepare(statement)
            row = await prepared.fetchrow(*values)
        except asyncio.CancelledError:
            try:
                if statement is WAIT_LOCK:
                    # The backend is queued for the lock: unless the statement is
                    # cancelled on the server it stays queued (and may even be granted
                    # the lock) until it notices that its client is gone. Cancelling the
                    # query made asyncpg send a cancel request; close() waits for it to
                    # be acknowledged and ends the session, all bounded by
                    # CANCEL_TIMEOUT_S. The CancelledError is re-raised below (a
                    # KeyboardInterrupt or SystemExit meanwhile is not lost).
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await conn.close(timeout=CANCEL_TIMEOUT_S)
            finally:
                conn.terminate()
            raise
        return None if row is None else tuple(row)

    async def _fetch_all(self, statement: Statement, values: tuple[Any, ...]) -> list[Any]:
        try:
            prepared = self._statements.get(statement) or await self._prepare(statement)
            return [tuple(row) for row in await prepared.fetch(*values)]
        except asyncio.CancelledError:
            self._conn.terminate()
            raise

    async def _listen(self, channel: str) -> None:
        inbox = self._inbox
        if inbox is None:
            inbox = self._inbox = asyncio.Queue()
            # asyncpg reads its socket all the time: a lost connection ends the wait.
            self._conn.add_termination_listener(lambda _conn: inbox.put_nowait(None))
        # The callback's arguments: the connection, the sender's pid, the channel, payload.
        await self._conn.add_listener(channel, lambda _c, pid, _ch, p: inbox.put_nowait((pid, p)))

    async def _receive(self, timeout_s: float) -> list[tuple[int, str]]:
        inbox = self._inbox
        if inbox is None:
            raise ConnectionError("not listening")
        if inbox.empty() and not self._conn.is_closed():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    inbox.put_nowait(await inbox.get())
        received: list[tuple[int, str]] = []
        while not inbox.empty():
            notification = inbox.get_nowait()
            if notification is None:
                break
            received.append(notification)
        if self._conn.is_closed():
            raise ConnectionError("the connection is closed")
        return received

    def _classify(self, exc: Exception) -> ErrorClass:
        return _classify(exc, self._conn)

    def _closed(self) -> bool:
        return bool(self._conn.is_closed())

    async def _execute_ddl(self, sql: str) -> None:
        if self._watch is not None:
            self.watch(None)
        await self._conn.execute(sql)

    def _protocol_pid(self) -> int | None:
        pid = self._conn.get_server_pid()
        return pid if isinstance(pid, int) else None

    async def _reset(self) -> None:
        if self._conn.is_in_transaction():
            await self._conn.execute("ROLLBACK")
        self._ready = True

    def _abort(self) -> None:
        self._conn.terminate()

    async def _close(self) -> None:
        # terminate() writes the Terminate message if the socket takes it at once and
        # closes the socket: no network wait, so a stuck network cannot hold it up.
        self._conn.terminate()

    def _socket(self) -> int:
        transport = getattr(self._conn, "_transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        return sock.fileno() if sock is not None else -1

    def _arm(self) -> None:
        # asyncpg reads its socket all the time: its termination listener is the watch.
        self._conn.add_termination_listener(self._listener)

    def _disarm(self) -> None:
        self._conn.remove_termination_listener(self._listener)


def _hosts(dsn: str) -> list[tuple[str, int | None]]:
    """The hosts of a URL DSN, in order (``host1:port1,host2:port2``)."""
    netloc = urlsplit(dsn).netloc.rpartition("@")[2]
    hosts: list[tuple[str, int | None]] = []
    for item in netloc.split(","):
        host, port = item, None
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") and rest[1:] else None
        elif item.count(":") == 1:
            host, text = item.split(":")
            port = int(text) if text else None
        hosts.append((host, port))
    return hosts


def check_dsn(dsn: str) -> None:
    """Raise [`ConfigurationError`][pgleaderlock.ConfigurationError] unless ``dsn`` is a
    URL asyncpg takes, with numeric ports and a ``target_session_attrs`` that keeps the
    lock on a primary.

    asyncpg accepts only the URL form (``postgresql://user@host:port/db?...``), not
    libpq's ``key=value`` form.
    """
    if not isinstance(dsn, str):
        raise ConfigurationError(f"the asyncpg backend needs a DSN string, got {dsn!r}")
    try:
        parts = urlsplit(dsn)
        scheme_ok = parts.scheme.lower() in ("postgres", "postgresql")
        if scheme_ok:
            for _, port in _hosts(dsn):
                if port is not None and not 0 < port < 65536:
                    raise ValueError(f"port {port} out of range")
    except ValueError as exc:
        raise malformed_dsn(dsn, exc) from None
    if not scheme_ok:
        raise malformed_dsn(
            dsn,
            "the asyncpg backend needs a postgresql://user@host:port/dbname URL"
            " (not the key=value form)",
        )
    attrs = parse_qs(parts.query).get("target_session_attrs")
    check_target_session_attrs(attrs[-1] if attrs else None, dsn)
    _per_host_timeout(dsn, 1.0)  # a bad connect_timeout fails here, before any I/O


def _per_host_timeout(dsn: str, connect_timeout_s: float) -> tuple[str, float]:
    """asyncpg has no ``connect_timeout`` URL parameter (it would send it to the server
    as a setting, which fails): take it out of the URL and use it per host, as libpq
    does; else ``connect_timeout_s``."""
    parts = urlsplit(dsn)
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = [value for name, value in query if name == "connect_timeout"]
    if not given:
        return dsn, connect_timeout_s
    rest = urlencode([(name, value) for name, value in query if name != "connect_timeout"])
    try:
        timeout = float(given[-1])
    except ValueError:
        raise malformed_dsn(dsn, "bad connect_timeout") from None
    return parts._replace(query=rest).geturl(), timeout if timeout > 0 else connect_timeout_s


def connect_budget(dsn: str, connect_timeout_s: float) -> float:
    """Each host gets its own attempt of ``connect_timeout_s`` (or the URL's own
    ``connect_timeout``)."""
    _, per_host = _per_host_timeout(dsn, connect_timeout_s)
    return max(1, len(_hosts(dsn))) * per_host


async def connect(dsn: str, options: ConnectOptions) -> LockSession:
    """Open a new dedicated session with its ``application_name``.

    asyncpg's own timeout covers all the hosts of a multi-host DSN together, so that a
    dead first host would use it all up; here each host gets an attempt of its own,
    within ``connect_timeout_s``, in order, with ``target_session_attrs=read-write``
    (unless the DSN says ``primary``) so that a standby is passed over. The session
    settings are applied later by ``configure()`` (a pooler refuses them as startup
    parameters).
    """
    dsn, per_host = _per_host_timeout(dsn, options.connect_timeout_s)
    hosts = _hosts(dsn)
    attrs = parse_qs(urlsplit(dsn).query).get("target_session_attrs")
    target = attrs[-1] if attrs else ("read-write" if len(hosts) > 1 else None)
    settings = {"application_name": options.application_name}
    last: BaseException | None = None
    for host, port in hosts if len(hosts) > 1 else [(None, None)]:
        try:
            conn = await asyncpg.connect(
                dsn,
                host=host,
                port=port,
                timeout=per_host,
                server_settings=settings,
                target_session_attrs=target,
            )
        except Exception as exc:
            last = exc
            if len(hosts) > 1 and _try_next_host(exc):
                continue
            raise _connect_error(exc) from exc
        return AsyncpgSession(conn)
    assert last is not None
    raise _connect_error(last) from last


def _try_next_host(exc: BaseException) -> bool:
    """Like libpq, move on to the next host after a connection failure or a standby,
    not after the server refused the client (those are the same on every host)."""
    code = sqlstate(exc) if isinstance(exc, asyncpg.PostgresError) else None
    return code is None or by_sqlstate(code, REFUSED_SQLSTATES, ConnectionError) is ConnectionError


def _pooled(obj: Any) -> bool:
    # asyncpg hands out PoolConnectionProxy objects (which pass isinstance(Connection));
    # a raw Connection that belongs to a pool keeps a reference to its holder.
    if isinstance(obj, asyncpg.pool.PoolConnectionProxy):
        return True
    return (
        getattr(obj, "_pool_holder", None) is not None or getattr(obj, "_proxy", None) is not None
    )


def _give_back(obj: Any) -> Any:
    """A coroutine function that releases a pool's connection to its pool, or None."""
    holder = getattr(obj, "_holder", None) or getattr(obj, "_pool_holder", None)
    pool = getattr(holder, "_pool", None)
    if pool is None:
        return None
    return lambda: pool.release(obj)


def wrap(obj: object) -> LockSession | None:
    """Adapt an ``asyncpg.Connection`` returned by ``connect_fn``.

    Raises:
        PooledConnectionError: the connection belongs to an ``asyncpg.Pool`` (it is
            released back to the pool before the error is reported).
    """
    if not isinstance(obj, asyncpg.Connection):
        return None
    if _pooled(obj):
        raise PooledConnectionError(
            "connect_fn returned a connection that belongs to an asyncpg pool; a "
            "session-level lock needs a dedicated connection (asyncpg.connect()) that no "
            "pool can hand to someone else",
            give_back=_give_back(obj),
        )
    return AsyncpgSession(obj)


def fetch_row(
    conn: object, template: str, values: tuple[object, ...]
) -> Awaitable[tuple[Any, ...] | None] | None:
    """One statement in the caller's transaction on an asyncpg ``Connection`` (a pool's
    too: the caller's own work may run anywhere)."""
    if not isinstance(conn, asyncpg.Connection):
        return None
    return _fetch_row(conn, template, values)


async def _fetch_row(
    conn: Any, template: str, values: tuple[object, ...]
) -> tuple[Any, ...] | None:
    if not conn.is_in_transaction():
        raise ConfigurationError(
            "fencing must run inside the transaction it protects (`async with conn.transaction():`)"
        )
    sql = template.format(*[f"${n}" for n in range(1, len(values) + 1)])
    row = await conn.fetchrow(sql, *values)
    return None if row is None else tuple(row)


def transaction(conn: object) -> AbstractAsyncContextManager[object] | None:
    """``conn.transaction()`` of an asyncpg ``Connection`` (``None`` for another kind of
    connection)."""
    if not isinstance(conn, asyncpg.Connection):
        return None
    return cast(AbstractAsyncContextManager[object], conn.transaction())


backend = module_backend(__name__)
