"""The asyncpg backend: one dedicated ``asyncpg.Connection``, never one from a pool.

Driver calls only: the lock calls, the row and pid checks and the error wording are
[`BaseSession`][pgleaderlock.backends.BaseSession]'s. No retries, no timers: the core bounds
every call with a timeout and decides what a failure means.

Each session prepares its (at most four) statements once, with the keys as parameters, and
reuses them: one Bind/Execute round trip per call after the first. Every statement also
returns ``pg_backend_pid()`` for the pooler check. asyncpg reads its socket all the time, so
`AsyncpgSession.watch` uses asyncpg's termination listener instead of watching the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import asyncpg.pool

from ..core._logging import mask_dsn
from ..core.errors import (
    ConfigurationError,
    ConnectionError,
    LockError,
    SessionNotDedicatedError,
)
from ..core.session import Backend, ConnectOptions, LockSession
from .base import (
    CANCEL_TIMEOUT_S,
    CONNECTION_SQLSTATE_CLASSES,
    WAIT_LOCK,
    BaseSession,
    ErrorClass,
    Statement,
    by_sqlstate,
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


def _translate(exc: BaseException, what: str, conn: asyncpg.Connection | None = None) -> Exception:
    """``exc`` as the library error `_classify` names (the driver error is the
    ``__cause__``)."""
    return translate(exc, what, _classify(exc, conn))


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

    @property
    def connection(self) -> asyncpg.Connection:
        """The underlying driver connection."""
        return self._conn

    async def _prepare(self, statement: Statement) -> Any:
        if not self._ready:
            if self._conn.is_in_transaction():
                await self._conn.execute("ROLLBACK")
            self._ready = True
        placeholders = [f"${n}" for n in range(1, 4)]
        prepared = self._statements[statement] = await self._conn.prepare(
            statement.sql(*placeholders)
        )
        return prepared

    async def _fetch(self, statement: Statement, values: tuple[int, ...]) -> object:
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
            if statement is WAIT_LOCK:
                # The backend is queued for the lock: unless the statement is cancelled
                # on the server it stays queued (and may even be granted the lock) until
                # it notices that its client is gone. Cancelling the query made asyncpg
                # send a cancel request; close() waits for it to be acknowledged and ends
                # the session, all bounded by CANCEL_TIMEOUT_S.
                with contextlib.suppress(BaseException):  # the CancelledError is re-raised
                    await conn.close(timeout=CANCEL_TIMEOUT_S)
            conn.terminate()
            raise
        return None if row is None else tuple(row)

    def _classify(self, exc: Exception) -> ErrorClass:
        return _classify(exc, self._conn)

    def _closed(self) -> bool:
        return bool(self._conn.is_closed())

    def _abort(self) -> None:
        self._conn.terminate()

    async def _close(self) -> None:
        # terminate() writes the Terminate message if the socket takes it at once and
        # closes the socket: no network wait, so a stuck network cannot hold it up.
        self._conn.terminate()

    def _arm(self) -> None:
        # asyncpg reads its socket all the time: its termination listener is the watch.
        self._conn.add_termination_listener(self._listener)

    def _disarm(self) -> None:
        self._conn.remove_termination_listener(self._listener)


def check_dsn(dsn: str) -> None:
    """Raise [`ConfigurationError`][pgleaderlock.ConfigurationError] unless ``dsn`` is a URL
    asyncpg takes.

    asyncpg accepts only the URL form (``postgresql://user@host:port/db?...``), not
    libpq's ``key=value`` form.
    """
    if not isinstance(dsn, str):
        raise ConfigurationError(f"the asyncpg backend needs a DSN string, got {dsn!r}")
    try:
        parts = urlsplit(dsn)
        scheme_ok = parts.scheme.lower() in ("postgres", "postgresql")
        if scheme_ok and "," not in parts.netloc:
            _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ConfigurationError(f"malformed DSN {mask_dsn(dsn)!r}: {exc}") from None
    if not scheme_ok:
        raise ConfigurationError(
            f"malformed DSN {mask_dsn(dsn)!r}: the asyncpg backend needs a "
            "postgresql://user@host:port/dbname URL (not the key=value form)"
        )


async def connect(dsn: str, options: ConnectOptions) -> LockSession:
    """Open a new dedicated session (``application_name``, server settings, timeout).

    Settings given in the DSN's query string are kept; ``application_name`` and the
    lock's server settings win over them.
    """
    settings: dict[str, str] = {**options.server_settings}
    settings["application_name"] = options.application_name
    try:
        conn = await asyncpg.connect(
            dsn, timeout=options.connect_timeout_s, server_settings=settings
        )
    except Exception as exc:
        raise _translate(exc, "connect") from exc
    return AsyncpgSession(conn)


def _pooled(obj: Any) -> bool:
    # asyncpg hands out PoolConnectionProxy objects (which pass isinstance(Connection));
    # a raw Connection that belongs to a pool keeps a reference to its holder.
    if isinstance(obj, asyncpg.pool.PoolConnectionProxy):
        return True
    return (
        getattr(obj, "_pool_holder", None) is not None or getattr(obj, "_proxy", None) is not None
    )


def wrap(obj: object) -> LockSession | None:
    """Adapt an ``asyncpg.Connection`` returned by ``connect_fn``.

    Raises:
        ConfigurationError: the connection belongs to an ``asyncpg.Pool``.
    """
    if not isinstance(obj, asyncpg.Connection):
        return None
    if _pooled(obj):
        raise ConfigurationError(
            "connect_fn returned a connection that belongs to an asyncpg pool; a "
            "session-level lock needs a dedicated connection (asyncpg.connect()) that no "
            "pool can hand to someone else"
        )
    return AsyncpgSession(obj)


backend = Backend(name="asyncpg", connect=connect, wrap=wrap, check_dsn=check_dsn)
