"""The session base: a session whose every statement is checked to run on its own
server backend, written once over a few driver calls.

[`CheckedSession`][pgleaderlock.backends.checked.CheckedSession] holds what a subclass
implements (the driver calls), the checked row (the session's token and
``pg_backend_pid()`` in every statement's last two columns), the session's setup
(``identify``, ``configure``: the connect and setup statements), the probes (``ping``,
``holds``, the cheap probe) and the connection's end (``watch``, ``abort``, ``close``).
The lock calls and the wait are [`LockingSession`][pgleaderlock.backends.locking.LockingSession]'s,
built on it; [`BaseSession`][pgleaderlock.backends.BaseSession] adds the library's
tables, fencing, many locks and notifications. It imports no driver.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..lowlevel import (
    ConnectionError,
    ConnectOptions,
    SessionInfo,
    SessionNotDedicatedError,
    StandbyError,
    key_to_oid,
)
from .errors import ErrorClass, check_pid, translate
from .sockets import tcp_acknowledged
from .sql import (
    ALIVE,
    CANCEL_TIMEOUT_S,
    FORGET,
    HOLDS,
    IDENTIFY,
    Statement,
    configure_statement,
    setup_statement,
)

__all__ = ["CheckedSession"]

T = TypeVar("T")

_SESSION_TOKENS = random.SystemRandom()

_NOW_A_STANDBY = "health check: the server is now a standby (in recovery)"


class CheckedSession(abc.ABC):
    """The session base of [`BaseSession`][pgleaderlock.backends.BaseSession] (see the
    module docstring): its driver calls, checked rows, setup, probes and end."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._watch: Callable[[], None] | None = None
        self._info: SessionInfo | None = None
        self._token = _SESSION_TOKENS.getrandbits(62) + 1  # marks the session's backend
        self._configured = False  # the lock's settings are applied
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

    async def _before_statement(self, statement: Statement) -> None:  # noqa: B027 - optional
        """``statement`` is about to run: end what runs on the session between calls
        first (default: nothing; `LockingSession` drops a wait in flight)."""

    async def _cancel_wait(self) -> None:  # noqa: B027 - optional
        """End the statement in flight between calls, if any, and wait for it to end
        (default: there is none; see `LockingSession`)."""

    # ------------------------------------------------ the checked statement

    async def _row(self, statement: Statement, values: tuple[Any, ...]) -> tuple[object, ...]:
        """Run ``statement``; return its row after checking its last two columns: the
        session's token and its backend's pid."""
        if self._watch is not None:
            self.watch(None)  # never compete with the driver for the connection
        await self._before_statement(statement)
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

    # ------------------------------------------------ probes

    async def ping(self) -> None:
        """Check that the session answers, on its own backend
        ([`ALIVE`][pgleaderlock.backends.ALIVE])."""
        await self._row(ALIVE, ())

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

    # ------------------------------------------------ the connection

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
