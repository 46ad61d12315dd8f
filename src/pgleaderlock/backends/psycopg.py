"""The psycopg 3 backend: one dedicated ``psycopg.AsyncConnection`` in autocommit.

Thin I/O only: no retries, no timers. The core bounds every call with a timeout and
decides what a failure means.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..core._logging import mask_dsn
from ..core.errors import ConfigurationError, ConnectionError, LockError
from ..core.session import Backend, ConnectOptions, LockSession
from . import _sql

__all__ = ["PsycopgSession", "backend", "check_dsn", "connect", "wrap"]


def _translate(exc: psycopg.Error, what: str) -> Exception:
    """Map a driver error onto the library's hierarchy (the driver error is the cause)."""
    message = mask_dsn(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
    cls = (
        ConnectionError
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
        else LockError
    )
    err = cls(f"{what}: {type(exc).__name__}: {message}")
    err.__cause__ = exc
    return err


class PsycopgSession:
    """A :class:`~pgleaderlock.LockSession` over one psycopg ``AsyncConnection``.

    Args:
        conn: a dedicated connection; it must not come from a pool. It is switched to
            autocommit before its first statement.
    """

    def __init__(self, conn: psycopg.AsyncConnection[object]) -> None:
        self._conn = conn
        self._pid: int | None = None
        self._ready = conn.autocommit
        self._watch: Callable[[], None] | None = None
        self._cursor: psycopg.AsyncCursor[Any] | None = None
        self._queries: dict[tuple[object, ...], bytes] = {}

    @property
    def connection(self) -> psycopg.AsyncConnection[object]:
        """The underlying driver connection."""
        return self._conn

    @property
    def backend_pid(self) -> int | None:
        return self._pid

    async def _execute(self, query: bytes) -> object:
        if self._watch is not None:
            self.watch(None)  # psycopg waits on the same fd; asyncio keeps one reader per fd
        cursor = self._cursor
        if cursor is None:
            if not self._ready:
                await self._conn.set_autocommit(True)
                self._ready = True
            cursor = self._cursor = self._conn.cursor()
        await cursor.execute(query)
        return await cursor.fetchone()

    def _query(self, template: str, **fields: object) -> bytes:
        """The statement for ``template`` and ``fields``, formatted once per session."""
        key = (template, *fields.values())
        query = self._queries.get(key)
        if query is None:
            query = self._queries[key] = template.format(**fields).encode()
        return query

    def abort(self) -> None:
        """Drop the connection at once, with no network wait (see ``AbortableSession``).

        psycopg answers the cancellation of a running query by cancelling it on the
        server and waiting for that, up to 10 s: far too long when the network is
        stuck. The core calls this before it cancels a call that timed out, so psycopg
        finds no active query left to cancel. psycopg's reader comes off the event loop
        before the fd is closed, so that the fd number cannot be reused under it.
        """
        self.watch(None)
        if self._conn.closed:
            return
        pgconn = self._conn.pgconn
        with contextlib.suppress(Exception):
            loop = asyncio.get_running_loop()
            loop.remove_reader(pgconn.socket)
            loop.remove_writer(pgconn.socket)
        pgconn.finish()

    async def _row(
        self, query: bytes, what: str, *, cancel_on_server: bool = False
    ) -> tuple[object, int]:
        """Run ``query``; its first column is the value, its last ``pg_backend_pid()``.

        With ``cancel_on_server``, an interrupted call first asks the server to cancel
        the statement (bounded by ``_sql.CANCEL_TIMEOUT_S``): a backend queued for a lock
        would otherwise stay queued, and could be granted it, until it notices that its
        client is gone. That needs the query in a task of its own, so it is kept for the
        long server-side wait; every other call runs inline and is aborted if cancelled.
        """
        try:
            if cancel_on_server:
                row = await self._cancellable(query)
            else:
                row = await self._execute(query)
        except asyncio.CancelledError:
            self.abort()
            raise
        except psycopg.Error as exc:
            raise _translate(exc, what) from exc
        if not isinstance(row, tuple) or len(row) < 2 or not isinstance(row[-1], int):
            raise ConnectionError(f"{what}: unexpected result {row!r}")
        value, pid = row[0], row[-1]
        if pid != self._pid:
            _sql.check_pid(self._pid, pid)
            self._pid = pid
        return value, pid

    async def _cancellable(self, query: bytes) -> object:
        task = asyncio.get_running_loop().create_task(self._execute(query))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout(_sql.CANCEL_TIMEOUT_S):
                    await self._conn.cancel_safe()
            except BaseException:  # best effort; CancelledError is re-raised below
                pass
            finally:
                self.abort()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise

    async def try_lock(self, key1: int, key2: int) -> bool:
        value, _ = await self._row(self._query(_sql.TRY_LOCK, k1=key1, k2=key2), "try_lock")
        return bool(value)

    async def unlock(self, key1: int, key2: int) -> bool:
        value, _ = await self._row(self._query(_sql.UNLOCK, k1=key1, k2=key2), "unlock")
        return bool(value)

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        query = _sql.WAIT_LOCK.format(k1=key1, k2=key2, ms=_sql.lock_timeout_ms(timeout_s))
        query_bytes = query.encode()  # not cached: the timeout varies
        try:
            await self._row(query_bytes, "wait_lock", cancel_on_server=True)
        except (ConnectionError, LockError) as exc:
            cause = exc.__cause__
            if isinstance(cause, psycopg.Error) and cause.sqlstate == _sql.LOCK_NOT_AVAILABLE:
                return False  # lock_timeout: the wait ended without the lock
            raise
        return True

    def watch(self, callback: Callable[[], None] | None) -> None:
        if self._watch is not None:
            self._watch = None
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._conn.pgconn.socket)
        if callback is not None and not self._conn.closed:
            self._watch = callback
            asyncio.get_running_loop().add_reader(self._conn.pgconn.socket, self._readable)

    def _readable(self) -> None:
        callback = self._watch
        self.watch(None)
        if callback is not None:
            callback()

    async def holds(self, key1: int, key2: int) -> bool:
        query = self._query(_sql.HOLDS, c=_sql.oid(key1), o=_sql.oid(key2))
        value, _ = await self._row(query, "health check")
        return bool(value)

    async def close(self) -> None:
        # AsyncConnection.close() does no network wait (libpq's PQfinish on a
        # non-blocking socket), so a stuck network cannot hold it up.
        self.watch(None)
        with contextlib.suppress(Exception):
            await self._conn.close()

    def __repr__(self) -> str:
        return f"<PsycopgSession backend_pid={self._pid} closed={self._conn.closed}>"


def _options(existing: str | None, settings: Mapping[str, str]) -> str:
    extra = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return f"{existing} {extra}".strip() if existing else extra


def check_dsn(dsn: str) -> None:
    """Raise :class:`~pgleaderlock.ConfigurationError` if libpq cannot parse ``dsn``."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        raise ConfigurationError(f"malformed DSN {mask_dsn(dsn)!r}: {mask_dsn(str(exc))}") from None


async def connect(dsn: str, options: ConnectOptions) -> LockSession:
    """Open a new dedicated session (autocommit, ``application_name``, server settings)."""
    params = conninfo_to_dict(dsn)
    existing = params.get("options")
    try:
        conn = await psycopg.AsyncConnection.connect(
            dsn,
            autocommit=True,
            application_name=options.application_name,
            connect_timeout=max(2, math.ceil(options.connect_timeout_s)),
            options=_options(str(existing) if existing else None, options.server_settings),
        )
    except psycopg.Error as exc:
        raise _translate(exc, "connect") from exc
    return PsycopgSession(conn)


def wrap(obj: object) -> LockSession | None:
    """Adapt a psycopg ``AsyncConnection`` returned by ``connect_fn``."""
    if not isinstance(obj, psycopg.AsyncConnection):
        return None
    if getattr(obj, "_pool", None) is not None:
        raise ConfigurationError(
            "connect_fn returned a connection that belongs to a pool; a session-level "
            "lock needs a dedicated connection that no pool can hand to someone else"
        )
    return PsycopgSession(obj)


backend = Backend(name="psycopg", connect=connect, wrap=wrap, check_dsn=check_dsn)
