"""The psycopg 3 backend: one dedicated ``psycopg.AsyncConnection`` in autocommit.

Driver calls only: the lock calls, the row and pid checks and the error wording are
[`BaseSession`][pgleaderlock.backends.BaseSession]'s. No retries, no timers: the core bounds
every call with a timeout and decides what a failure means.

Each session formats its statements once (the keys are literals) and keeps the bytes;
an idle session's socket is watched on the event loop, and the periodic probe is a bare
protocol ``Sync`` answered through that same watch (see `PsycopgSession._start_alive`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
from collections.abc import Awaitable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, cast

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from ..lowlevel import (
    ConfigurationError,
    ConnectionError,
    ConnectOptions,
    LockError,
    LockSession,
    PooledConnectionError,
    ServerRefusedError,
)
from .base import (
    CANCEL_TIMEOUT_S,
    WAIT_LOCK,
    BaseSession,
    ErrorClass,
    Statement,
    check_target_session_attrs,
    malformed_dsn,
    misconfigured_by_message,
    module_backend,
    refused_by_message,
    translate,
)

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
        self._sync: asyncio.Future[None] | None = None  # a probe's Sync awaits its answer
        self._sync_io = 0  # what the probe added to the event loop (_READER, _WRITER)
        # The fd the probe's and the watch's callbacks are on: libpq closes the socket when
        # it finds the connection closed, and they must come off the event loop all the
        # same (a new connection may get the fd number, see `_answer`).
        self._sync_fd = -1
        self._watch_fd = -1

    @property
    def connection(self) -> psycopg.AsyncConnection[object]:
        """The underlying driver connection."""
        return self._conn

    async def _fetch(self, statement: Statement, values: tuple[Any, ...]) -> object:
        """Run ``statement``: integer values are formatted in, and the bytes kept for the
        session, except for the wait, whose timeout varies; other values (the
        coordinator's lists and strings) are sent as parameters.

        The long server-side wait runs in a task of its own, so that an interrupted wait can
        first ask the server to cancel the statement (see `_cancellable`). Every other call
        runs inline and drops the connection if cancelled.
        """
        if statement is WAIT_LOCK:
            return await self._cancellable(statement.sql(*values).encode())
        if not all(type(value) is int for value in values):
            return await self._with_parameters(statement, values, all_rows=False)
        key = (statement, *values)
        query = self._queries.get(key)
        if query is None:
            query = self._queries[key] = statement.sql(*values).encode()
        try:
            return await self._execute(query)
        except asyncio.CancelledError:
            self.abort()
            raise

    async def _fetch_all(self, statement: Statement, values: tuple[Any, ...]) -> list[Any]:
        return cast(list[Any], await self._with_parameters(statement, values, all_rows=True))

    async def _with_parameters(
        self, statement: Statement, values: tuple[Any, ...], *, all_rows: bool
    ) -> object:
        query, params = _with_params(statement.template, values)
        if self._watch is not None:
            self.watch(None)
        try:
            cursor = self._conn.cursor()
            await cursor.execute(query, params)
            return await (cursor.fetchall() if all_rows else cursor.fetchone())
        except asyncio.CancelledError:
            self.abort()
            raise

    async def _listen(self, channel: str) -> None:
        await self._conn.execute(f'LISTEN "{channel}"'.encode())

    async def _receive(self, timeout_s: float) -> list[tuple[int, str]]:
        # psycopg keeps what arrives between calls and returns it first.
        notifies = self._conn.notifies(timeout=timeout_s, stop_after=1)
        return [(n.pid, n.payload) async for n in notifies]

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
                    # The statement ends (cancelled) before the connection goes: a
                    # backend still waiting when its client vanishes logs a FATAL
                    # "connection to client lost" (client_connection_check_interval).
                    await asyncio.wait((task,))
            except (Exception, asyncio.CancelledError):  # best effort; re-raised below
                pass  # (KeyboardInterrupt, SystemExit: not swallowed)
            finally:
                self.abort()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise

    def _start_alive(self) -> asyncio.Future[None] | None:
        """The periodic probe: a bare protocol ``Sync``, which the session's own backend
        answers with ``ReadyForQuery``. No statement runs: the server's cost is a third
        of the [`ALIVE`][pgleaderlock.backends.ALIVE] statement's, and the client's is a
        few libpq calls. The reply comes
        through the socket's watch, which stays on the event loop (no reader added and
        removed per probe, no cursor, no result rows).

        Needs libpq's pipeline mode (libpq >= 14) and an idle connection; otherwise
        ``None`` (the probe is then the [`ALIVE`][pgleaderlock.backends.ALIVE] statement).
        """
        conn = self._conn
        pgconn = conn.pgconn
        if not _CAN_SYNC or conn.closed or pgconn.transaction_status != TransactionStatus.IDLE:
            return None
        loop = asyncio.get_running_loop()
        reply = self._sync = loop.create_future()
        fd = self._sync_fd = pgconn.socket
        try:
            pgconn.enter_pipeline_mode()
            pgconn.pipeline_sync()
            if pgconn.flush():  # the socket's buffer is full: finish sending when it drains
                loop.add_writer(fd, self._flush)
                self._sync_io |= _WRITER
            if self._watch is None:  # else the watch's reader also takes the reply
                loop.add_reader(fd, self._on_readable)
                self._sync_io |= _READER
        except psycopg.Error as exc:
            self._answer(exc)
        return reply

    def _flush(self) -> None:
        try:
            if self._conn.pgconn.flush() == 0:
                asyncio.get_running_loop().remove_writer(self._conn.pgconn.socket)
                self._sync_io &= ~_WRITER
        except psycopg.Error as exc:
            self._answer(exc)

    def _on_readable(self) -> None:
        """The socket is readable: the answer to a probe's ``Sync``, or (no probe in
        flight) the server ending the idle session."""
        if self._sync is None:
            self._fire()
            return
        pgconn = self._conn.pgconn
        try:
            try:
                pgconn.consume_input()
            except psycopg.OperationalError as exc:
                # Read to the end of the connection: the server's last words may be in
                # libpq's buffer still (its ErrorResponse came in the same read as the
                # answer to the previous Sync, and the end of the connection only now).
                raise self._server_said() or exc from None
            if pgconn.is_busy():
                return  # part of the answer: wait for the rest
            result = pgconn.get_result()
            if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
                # The server ended the session (terminated, shut down, its lease ran out):
                # its own message, not the protocol's.
                raise psycopg.errors.error_from_result(result, self._conn.info.encoding)
            if result is None or result.status != pq.ExecStatus.PIPELINE_SYNC:
                status = "none" if result is None else pq.ExecStatus(result.status).name
                raise psycopg.OperationalError(f"unexpected answer to a Sync: {status}")
            pgconn.exit_pipeline_mode()
        except psycopg.Error as exc:
            self._answer(exc)
            return
        self._answer(None)

    def _server_said(self) -> psycopg.Error | None:
        """The error the server sent before it closed the connection (``AdminShutdown``,
        ``IdleSessionTimeout``), if libpq read it; ``None`` if not. libpq keeps the
        data it read when it finds the connection closed, so its results still give
        the server's message, which ``consume_input`` replaced by its own ("server
        closed the connection unexpectedly")."""
        pgconn = self._conn.pgconn
        with contextlib.suppress(Exception):
            for _ in range(_RESULTS_AFTER_CLOSE):
                result = pgconn.get_result()
                if result is None:
                    break
                if result.status == pq.ExecStatus.FATAL_ERROR and result.error_field(
                    pq.DiagnosticField.SQLSTATE
                ):  # libpq's own errors have no SQLSTATE
                    return psycopg.errors.error_from_result(result, self._conn.info.encoding)
        return None

    def _answer(self, error: psycopg.Error | None, *, abort: bool = True) -> None:
        """The probe in flight is over: resolve its future (failed: translated, and the
        session aborted) and undo what the probe put on the event loop."""
        reply, self._sync = self._sync, None
        if reply is None:
            return
        io, self._sync_io = self._sync_io, 0
        # Even on a connection libpq has closed (its fd closed too): else the event loop
        # keeps the callback under that fd number, and the next connection that gets the
        # number fails ("connection socket closed") when psycopg waits on it.
        if io:
            loop = asyncio.get_running_loop()
            if io & _WRITER:
                with contextlib.suppress(Exception):
                    loop.remove_writer(self._sync_fd)
            if io & _READER and self._watch is None:  # a watch armed since keeps it
                with contextlib.suppress(Exception):
                    loop.remove_reader(self._sync_fd)
        if error is not None and abort:
            self.abort()
        if reply.done():
            return
        if error is None:
            reply.set_result(None)
        else:
            reply.set_exception(_probe_failure(error))

    def _classify(self, exc: Exception) -> ErrorClass | None:
        return _classify(exc)

    def _closed(self) -> bool:
        return self._conn.closed

    async def _execute_ddl(self, sql: str) -> None:
        if self._watch is not None:
            self.watch(None)
        await self._conn.execute(sql.encode())

    def _protocol_pid(self) -> int | None:
        return self._conn.info.backend_pid

    async def _reset(self) -> None:
        if self._conn.info.transaction_status != TransactionStatus.IDLE:
            await self._conn.rollback()  # the lock must be session-level, never in a txn
        if not self._conn.autocommit:
            await self._conn.set_autocommit(True)
        self._ready = True

    def _abort(self) -> None:
        """psycopg answers the cancellation of a running query by cancelling it on the
        server and waiting for that, up to 10 s: far too long when the network is
        stuck. The core calls ``abort()`` before it cancels a call that timed out, so
        psycopg finds no active query left to cancel. psycopg's reader comes off the
        event loop before the fd is closed, so that the fd number cannot be reused
        under it."""
        if not self._conn.closed:
            pgconn = self._conn.pgconn
            with contextlib.suppress(Exception):
                loop = asyncio.get_running_loop()
                loop.remove_reader(pgconn.socket)
                loop.remove_writer(pgconn.socket)
            pgconn.finish()
        self._answer(psycopg.OperationalError("the session was aborted"), abort=False)

    async def _close(self) -> None:
        # AsyncConnection.close() does no network wait (libpq's PQfinish on a
        # non-blocking socket), so a stuck network cannot hold it up.
        await self._conn.close()

    def _socket(self) -> int:
        return -1 if self._conn.closed else self._conn.pgconn.socket

    def _arm(self) -> None:
        # psycopg waits on the same fd for its queries; asyncio keeps one reader per fd,
        # which is why every statement disarms the watch first.
        self._watch_fd = self._conn.pgconn.socket
        asyncio.get_running_loop().add_reader(self._watch_fd, self._on_readable)

    def _disarm(self) -> None:
        asyncio.get_running_loop().remove_reader(self._watch_fd)  # the fd may be closed


# The probe's bare Sync needs pipeline mode (libpq >= 14).
_CAN_SYNC = pq.version() >= 140000
_READER, _WRITER = 1, 2
_RESULTS_AFTER_CLOSE = 4  # results looked at for the server's last message (bounded)


def _probe_failure(exc: psycopg.Error) -> Exception:
    error = translate(exc, "health check", ConnectionError)
    error.__cause__ = exc
    return error


def _hosts(params: Mapping[str, Any]) -> int:
    """How many hosts libpq will try (``host`` or ``hostaddr`` lists)."""
    hosts = str(params.get("host") or params.get("hostaddr") or "")
    return max(1, len(hosts.split(",")))


def check_dsn(dsn: str) -> None:
    """Raise [`ConfigurationError`][pgleaderlock.ConfigurationError] if libpq cannot
    parse ``dsn``, if a port is not a number, or if ``target_session_attrs`` would let
    the lock settle on a standby."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        raise malformed_dsn(dsn, exc) from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise malformed_dsn(dsn, f"bad port {port!r}")
    timeout = str(params.get("connect_timeout") or "0")
    if not timeout.lstrip("-").isdigit():
        raise malformed_dsn(dsn, "bad connect_timeout")
    check_target_session_attrs(params.get("target_session_attrs"), dsn)


def connect_budget(dsn: str, connect_timeout_s: float) -> float:
    """libpq tries each host in turn, each within the DSN's ``connect_timeout`` if it
    has one, else ``connect_timeout_s`` (both at least 2 s, as libpq has it)."""
    params = conninfo_to_dict(dsn)
    per_host = float(params.get("connect_timeout") or 0) or connect_timeout_s
    return _hosts(params) * max(2.0, math.ceil(per_host))


# psycopg >= 3.2 wakes every task that waits on a query every 100 ms (its ``wait()``
# "interval"), so that a sync caller could see Ctrl-C; in asyncio a cancellation needs no
# such wake-up. For a follower that waits on the server for seconds, with hundreds of
# them in one process, those wake-ups were most of the client's CPU: the library's own
# connections wait without them.
_QUIET_INTERVAL_S = 3600.0
_HAS_INTERVAL = "interval" in inspect.signature(psycopg.AsyncConnection.wait).parameters


class _QuietConnection(psycopg.AsyncConnection[Any]):
    """An ``AsyncConnection`` whose waits do not wake up every 100 ms."""

    async def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        if _HAS_INTERVAL and not args and "interval" not in kwargs:
            kwargs["interval"] = _QUIET_INTERVAL_S
        return await super().wait(gen, *args, **kwargs)


async def connect(dsn: str, options: ConnectOptions) -> LockSession:
    """Open a new dedicated session: autocommit, ``application_name``, each host within
    its own ``connect_timeout``; a multi-host DSN gets ``target_session_attrs=read-write``
    unless it says otherwise. The session settings are applied later by ``configure()``
    (a pooler refuses them as startup parameters)."""
    params = conninfo_to_dict(dsn)
    extra: dict[str, Any] = {}
    if not params.get("connect_timeout"):
        extra["connect_timeout"] = max(2, math.ceil(options.connect_timeout_s))
    if _hosts(params) > 1 and not params.get("target_session_attrs"):
        extra["target_session_attrs"] = "read-write"
    try:
        conn = await _QuietConnection.connect(
            dsn, autocommit=True, application_name=options.application_name, **extra
        )
    except psycopg.Error as exc:
        raise translate(exc, "connect", _connect_error_class(exc)) from exc
    return PsycopgSession(conn)


def connect_error(exc: BaseException) -> Exception | None:
    """A psycopg connect error: refused for good, or a connection error."""
    if not isinstance(exc, psycopg.Error):
        return None
    return translate(exc, "connect", _connect_error_class(exc))


def _connect_error_class(exc: psycopg.Error) -> ErrorClass:
    # libpq's connect errors carry no SQLSTATE: the server's message tells a refusal. A
    # connection option libpq itself rejects (a bad sslmode) is a ProgrammingError.
    if isinstance(exc, psycopg.ProgrammingError) or misconfigured_by_message(str(exc)):
        return ConfigurationError
    return ServerRefusedError if refused_by_message(str(exc)) else ConnectionError


def wrap(obj: object) -> LockSession | None:
    """Adapt a psycopg ``AsyncConnection`` returned by ``connect_fn``.

    Raises:
        PooledConnectionError: the connection belongs to a ``psycopg_pool`` pool (it is
            handed back to the pool before the error is reported).
    """
    if not isinstance(obj, psycopg.AsyncConnection):
        return None
    pool = getattr(obj, "_pool", None)
    if pool is not None:
        raise PooledConnectionError(
            "connect_fn returned a connection that belongs to a pool; a session-level "
            "lock needs a dedicated connection that no pool can hand to someone else",
            give_back=lambda: pool.putconn(obj),
        )
    return PsycopgSession(obj)


def _not_in_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE


_OUTSIDE = (
    "fencing must run inside the transaction it protects; this connection is in "
    "autocommit mode with no transaction open (use `async with conn.transaction():`)"
)


def fetch_row(
    conn: object, template: str, values: tuple[object, ...]
) -> Awaitable[tuple[Any, ...] | None] | None:
    """One statement in the caller's transaction on a psycopg ``AsyncConnection``
    (``None`` for another kind of connection)."""
    if not isinstance(conn, psycopg.AsyncConnection):
        return None
    return _fetch_row(conn, template, values)


async def _fetch_row(
    conn: psycopg.AsyncConnection[Any], template: str, values: tuple[object, ...]
) -> tuple[Any, ...] | None:
    if _not_in_transaction(conn):
        raise ConfigurationError(_OUTSIDE)
    cur = await conn.execute(*_with_params(template, values))
    row = await cur.fetchone()
    return None if row is None else tuple(row)


def transaction(conn: object) -> AbstractAsyncContextManager[object] | None:
    """``conn.transaction()`` of a psycopg ``AsyncConnection`` (``None`` for another
    kind of connection)."""
    if not isinstance(conn, psycopg.AsyncConnection):
        return None
    return conn.transaction()


def fetch_row_sync(
    conn: object, template: str, values: tuple[object, ...]
) -> tuple[tuple[Any, ...] | None] | None:
    """``fetch_row`` for a synchronous psycopg ``Connection`` (the threaded lock)."""
    if not isinstance(conn, psycopg.Connection):
        return None
    if _not_in_transaction(conn):
        raise ConfigurationError(_OUTSIDE.replace("async with", "with"))
    row = conn.execute(*_with_params(template, values)).fetchone()
    return (None if row is None else tuple(row),)


def _with_params(template: str, values: tuple[object, ...]) -> tuple[bytes, dict[str, object]]:
    """The query and its parameters, by name: a template may use a value twice, or out
    of order."""
    names = [f"v{i}" for i in range(len(values))]
    query = template.format(*[f"%({name})s" for name in names]).encode()
    return query, dict(zip(names, values, strict=True))


backend = module_backend(__name__)
