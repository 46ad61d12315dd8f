"""The psycopg 3 backend: one dedicated ``psycopg.AsyncConnection`` in autocommit.

Driver calls only: the lock calls, the row and pid checks and the error wording are
[`BaseSession`][pgleaderlock.backends.BaseSession]'s. No retries, no timers: the core bounds
every call with a timeout and decides what a failure means.

Each session formats its statements once (the keys are literals) and keeps the bytes;
an idle session's socket is watched on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..core._logging import mask_dsn
from ..core.errors import ConfigurationError, ConnectionError, LockError
from ..core.session import Backend, ConnectOptions, LockSession
from .base import CANCEL_TIMEOUT_S, WAIT_LOCK, BaseSession, ErrorClass, Statement, translate

__all__ = ["PsycopgSession", "backend", "check_dsn", "connect", "wrap"]


# psycopg sorts server errors by SQLSTATE class already (the classes in
# base.CONNECTION_SQLSTATE_CLASSES are OperationalError), so its types are the table.
_ERRORS: tuple[tuple[type[psycopg.Error], ErrorClass], ...] = (
    (psycopg.OperationalError, ConnectionError),
    (psycopg.InterfaceError, ConnectionError),
    (psycopg.Error, LockError),
)


def _classify(exc: BaseException) -> ErrorClass | None:
    """The library error for a psycopg error; ``None`` for anything else."""
    return next((cls for kind, cls in _ERRORS if isinstance(exc, kind)), None)


class PsycopgSession(BaseSession):
    """A [`LockSession`][pgleaderlock.LockSession] over one psycopg ``AsyncConnection``.

    Args:
        conn: a dedicated connection; it must not come from a pool. It is switched to
            autocommit before its first statement.
    """

    def __init__(self, conn: psycopg.AsyncConnection[object]) -> None:
        super().__init__()
        self._conn = conn
        self._ready = conn.autocommit
        self._cursor: psycopg.AsyncCursor[Any] | None = None
        self._queries: dict[tuple[object, ...], bytes] = {}

    @property
    def connection(self) -> psycopg.AsyncConnection[object]:
        """The underlying driver connection."""
        return self._conn

    async def _fetch(self, statement: Statement, values: tuple[int, ...]) -> object:
        """Run ``statement``: the values are formatted in (integers only), and the bytes
        kept for the session, except for the wait, whose timeout varies.

        The long server-side wait runs in a task of its own, so that an interrupted wait can
        first ask the server to cancel the statement (see `_cancellable`). Every other call
        runs inline and drops the connection if cancelled.
        """
        if statement is WAIT_LOCK:
            return await self._cancellable(statement.sql(*values).encode())
        key = (statement, *values)
        query = self._queries.get(key)
        if query is None:
            query = self._queries[key] = statement.sql(*values).encode()
        try:
            return await self._execute(query)
        except asyncio.CancelledError:
            self.abort()
            raise

    async def _execute(self, query: bytes) -> object:
        cursor = self._cursor
        if cursor is None:
            if not self._ready:
                await self._conn.set_autocommit(True)
                self._ready = True
            cursor = self._cursor = self._conn.cursor()
        await cursor.execute(query)
        return await cursor.fetchone()

    async def _cancellable(self, query: bytes) -> object:
        """Run ``query``; if cancelled, ask the server to cancel it first (bounded by
        ``CANCEL_TIMEOUT_S``): a backend queued for a lock would otherwise stay queued,
        and could be granted it, until it notices that its client is gone."""
        task = asyncio.get_running_loop().create_task(self._execute(query))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout(CANCEL_TIMEOUT_S):
                    await self._conn.cancel_safe()
            except BaseException:  # best effort; CancelledError is re-raised below
                pass
            finally:
                self.abort()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise

    def _classify(self, exc: Exception) -> ErrorClass | None:
        return _classify(exc)

    def _closed(self) -> bool:
        return self._conn.closed

    def _abort(self) -> None:
        """psycopg answers the cancellation of a running query by cancelling it on the
        server and waiting for that, up to 10 s: far too long when the network is
        stuck. The core calls ``abort()`` before it cancels a call that timed out, so
        psycopg finds no active query left to cancel. psycopg's reader comes off the
        event loop before the fd is closed, so that the fd number cannot be reused
        under it."""
        if self._conn.closed:
            return
        pgconn = self._conn.pgconn
        with contextlib.suppress(Exception):
            loop = asyncio.get_running_loop()
            loop.remove_reader(pgconn.socket)
            loop.remove_writer(pgconn.socket)
        pgconn.finish()

    async def _close(self) -> None:
        # AsyncConnection.close() does no network wait (libpq's PQfinish on a
        # non-blocking socket), so a stuck network cannot hold it up.
        await self._conn.close()

    def _arm(self) -> None:
        # psycopg waits on the same fd for its queries; asyncio keeps one reader per fd,
        # which is why every statement disarms the watch first.
        asyncio.get_running_loop().add_reader(self._conn.pgconn.socket, self._fire)

    def _disarm(self) -> None:
        asyncio.get_running_loop().remove_reader(self._conn.pgconn.socket)


def _options(existing: str | None, settings: Mapping[str, str]) -> str:
    extra = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return f"{existing} {extra}".strip() if existing else extra


def check_dsn(dsn: str) -> None:
    """Raise [`ConfigurationError`][pgleaderlock.ConfigurationError] if libpq cannot parse
    ``dsn``."""
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
        raise translate(exc, "connect", _classify(exc) or ConnectionError) from exc
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
