"""The asyncpg backend: one dedicated ``asyncpg.Connection``, never one from a pool.

Thin I/O only: no retries, no timers. The core bounds every call with a timeout and
decides what a failure means.

Each session prepares its (at most four) statements once, with the keys as parameters,
and reuses them: one Bind/Execute round trip per call after the first. Every statement
also returns ``pg_backend_pid()`` for the pooler check. asyncpg reads its socket all the
time, so :meth:`AsyncpgSession.watch` uses asyncpg's termination listener instead of
watching the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
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
from . import _sql

__all__ = ["AsyncpgSession", "backend", "check_dsn", "connect", "wrap"]


_TRY_LOCK = _sql.TRY_LOCK.format(k1="$1", k2="$2")
_UNLOCK = _sql.UNLOCK.format(k1="$1", k2="$2")
_HOLDS = _sql.HOLDS.format(c="$1", o="$2")
# The lock timeout is a parameter too, so that waits of any length share one prepared
# statement (a literal would add a statement to asyncpg's cache for every new value).
_WAIT_LOCK = _sql.WAIT_LOCK.replace("'{ms}'", "$3::text").format(k1="$1", k2="$2")
if "$3" not in _WAIT_LOCK:  # pragma: no cover - guards against a change in _sql
    raise RuntimeError("the shared WAIT_LOCK template changed: update the asyncpg adapter")

# SQLSTATE classes that mean "this session is unusable (or was never usable)": the same
# classes psycopg maps to OperationalError, so the same server error gives the same
# library error on every backend.
_CONNECTION_CLASSES = frozenset(
    {"08", "27", "28", "2F", "38", "39", "3B", "40", "53", "54", "55", "57", "58"}
)


# Our own prepared statement is missing, or its name is taken, on the server backend
# that ran the statement: another backend than the one that prepared it, i.e. a
# transaction-mode pooler (older PgBouncer fails this way before the pid check can).
_MOVED_SQLSTATES = frozenset({"26000", "42P05"})


def _is_connection_sqlstate(sqlstate: str | None) -> bool:
    if not sqlstate:
        return True
    return sqlstate[:2] in _CONNECTION_CLASSES or sqlstate[0] in "FH"


def _translate(exc: BaseException, what: str, conn: asyncpg.Connection | None = None) -> Exception:
    """Map an asyncpg (or socket) error onto the library's hierarchy.

    A server error on a live session is a :class:`~pgleaderlock.LockError`; anything
    else is a :class:`~pgleaderlock.ConnectionError`. After ``pg_terminate_backend``
    asyncpg may raise any of several types (``ConnectionDoesNotExistError``,
    ``InterfaceError``, ``InternalClientError``, ``AdminShutdownError``, ``OSError``):
    they all mean the session is gone. A missing (or clashing) prepared statement means
    the statement ran on another server backend than the session's own: a
    :class:`~pgleaderlock.SessionNotDedicatedError`. The driver error becomes the
    ``__cause__``.

    Args:
        exc: the error the driver raised.
        what: the operation, for the message (``"try_lock"``, ``"connect"``, ...).
        conn: the session's connection, if any: a closed one makes it a connection error.
    """
    sqlstate = getattr(exc, "sqlstate", None) if isinstance(exc, asyncpg.PostgresError) else None
    is_lock_error = (
        isinstance(exc, asyncpg.PostgresError)
        and not _is_connection_sqlstate(sqlstate)
        and conn is not None
        and not conn.is_closed()
    )
    text = str(exc).strip()
    message = mask_dsn(text.splitlines()[0] if text else repr(exc))
    if isinstance(exc, TimeoutError) and not text:
        message = "timed out"
    if sqlstate in _MOVED_SQLSTATES:
        moved = SessionNotDedicatedError(
            f"{what}: {type(exc).__name__}: {message}: the session's prepared statements "
            "are not on the server backend that ran this one, so a transaction-mode pooler "
            "(e.g. PgBouncer pool_mode=transaction) sits between this client and "
            "PostgreSQL. Session-level advisory locks need a direct connection or a "
            "session-mode pooler"
        )
        moved.__cause__ = exc
        return moved
    cls = LockError if is_lock_error else ConnectionError
    err = cls(f"{what}: {type(exc).__name__}: {message}")
    err.__cause__ = exc
    return err


class AsyncpgSession:
    """A :class:`~pgleaderlock.LockSession` over one ``asyncpg.Connection``.

    Args:
        conn: a dedicated connection; it must not come from an ``asyncpg.Pool``. An
            open transaction on it is rolled back before its first statement, so that
            the lock is session-level and the session is never idle in transaction.
    """

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self._pid: int | None = None
        self._ready = False
        self._watch: Callable[[], None] | None = None
        self._listener = self._on_terminated  # one bound method: asyncpg compares them
        # The session's own prepared statements: a little faster per call than
        # conn.fetchrow(), which looks the statement up in asyncpg's cache each time.
        self._statements: dict[str, Any] = {}

    @property
    def connection(self) -> asyncpg.Connection:
        """The underlying driver connection."""
        return self._conn

    @property
    def backend_pid(self) -> int | None:
        return self._pid

    async def _prepare(self) -> None:
        if self._conn.is_in_transaction():
            await self._conn.execute("ROLLBACK")
        self._ready = True

    async def _statement(self, query: str) -> Any:
        if not self._ready:
            await self._prepare()
        statement = self._statements[query] = await self._conn.prepare(query)
        return statement

    async def _row(self, query: str, args: tuple[object, ...], what: str) -> object:
        """Run ``query``; return its first column and check its last, ``pg_backend_pid()``.

        A cancelled call drops the connection at once: the core closes a session after
        any interrupted call anyway. (asyncpg answers the cancellation of a query by
        scheduling a cancel request over a new connection, and would not run another
        statement until the server acknowledged it, which a stuck network can delay
        indefinitely; terminate() withdraws that request before it goes out.)
        """
        if self._watch is not None:
            self.watch(None)
        conn = self._conn
        try:
            statement = self._statements.get(query)
            if statement is None:
                statement = await self._statement(query)
            row = await statement.fetchrow(*args)
        except asyncio.CancelledError:
            conn.terminate()
            raise
        except Exception as exc:
            raise _translate(exc, what, conn) from exc
        if row is None or len(row) < 2 or not isinstance(row[-1], int):
            raise ConnectionError(f"{what}: unexpected result {row!r}")
        pid: int = row[-1]
        if pid != self._pid:
            _sql.check_pid(self._pid, pid)
            self._pid = pid
        return row[0]

    async def try_lock(self, key1: int, key2: int) -> bool:
        return bool(await self._row(_TRY_LOCK, (key1, key2), "try_lock"))

    async def unlock(self, key1: int, key2: int) -> bool:
        return bool(await self._row(_UNLOCK, (key1, key2), "unlock"))

    async def holds(self, key1: int, key2: int) -> bool:
        return bool(await self._row(_HOLDS, (_sql.oid(key1), _sql.oid(key2)), "health check"))

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        if self._watch is not None:
            self.watch(None)
        conn = self._conn
        args = (key1, key2, str(_sql.lock_timeout_ms(timeout_s)))
        try:
            statement = self._statements.get(_WAIT_LOCK)
            if statement is None:
                statement = await self._statement(_WAIT_LOCK)
            row = await statement.fetchrow(*args)
        except asyncio.CancelledError:
            # The backend is queued for the lock: unless the statement is cancelled on
            # the server it stays queued (and may even be granted the lock) until it
            # notices that its client is gone. Cancelling the query made asyncpg send a
            # cancel request; close() waits for it to be acknowledged and ends the
            # session, all bounded by _sql.CANCEL_TIMEOUT_S.
            try:
                await conn.close(timeout=_sql.CANCEL_TIMEOUT_S)
            except BaseException:
                pass
            finally:
                conn.terminate()
            raise
        except asyncpg.exceptions.LockNotAvailableError as exc:
            if conn.is_closed():
                raise _translate(exc, "wait_lock", conn) from exc
            return False  # lock_timeout: the wait ended without the lock
        except Exception as exc:
            raise _translate(exc, "wait_lock", conn) from exc
        if row is None or len(row) < 2 or not isinstance(row[-1], int):
            raise ConnectionError(f"wait_lock: unexpected result {row!r}")
        pid: int = row[-1]
        _sql.check_pid(self._pid, pid)
        self._pid = pid
        return True

    def watch(self, callback: Callable[[], None] | None) -> None:
        if self._watch is not None:
            self._watch = None
            self._conn.remove_termination_listener(self._listener)
        if callback is None:
            return
        self._watch = callback
        if self._conn.is_closed():
            asyncio.get_running_loop().call_soon(self._fire)
        else:
            self._conn.add_termination_listener(self._listener)

    def _on_terminated(self, conn: object) -> None:
        self._fire()

    def _fire(self) -> None:
        callback = self._watch
        if callback is not None:
            self.watch(None)
            callback()

    def abort(self) -> None:
        """Drop the connection at once, with no network wait (``AbortableSession``)."""
        self.watch(None)
        with contextlib.suppress(Exception):
            self._conn.terminate()

    async def close(self) -> None:
        # terminate() writes the Terminate message if the socket takes it at once and
        # closes the socket: no network wait, so a stuck network cannot hold it up.
        self.watch(None)
        with contextlib.suppress(Exception):
            self._conn.terminate()

    def __repr__(self) -> str:
        return f"<AsyncpgSession backend_pid={self._pid} closed={self._conn.is_closed()}>"


def check_dsn(dsn: str) -> None:
    """Raise :class:`~pgleaderlock.ConfigurationError` unless ``dsn`` is a URL asyncpg takes.

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
