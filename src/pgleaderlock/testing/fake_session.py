"""The sessions of a [`FakeServer`][pgleaderlock.testing.FakeServer]: a
[`FakeSession`][pgleaderlock.testing.FakeSession] has every session capability a
``LeaderLock`` uses, and keeps its state (closed, killed, its lease, its watch) while the
server keeps the locks, the terms and the scripted failures."""

from __future__ import annotations

import asyncio
import builtins
import functools
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ..lowlevel import (
    BumpedTerm,
    ConnectionError,
    ConnectOptions,
    FencedSessions,
    LibraryTable,
    SessionInfo,
    TermTable,
)

if TYPE_CHECKING:
    from .fake import FakeServer

__all__ = ["PROBES", "FakeSession"]

P = ParamSpec("P")
T = TypeVar("T")

PROBES = ("holds", "start_probe")
"""The session methods that ``"probe"`` stands for in ``calls``, ``fail_calls``,
``hang()`` and ``delays``: whichever health probe the lock makes."""


def _statement(
    method: Callable[Concatenate[FakeSession, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[FakeSession, P], Coroutine[Any, Any, T]]:
    """A call in flight: the session is not idle, so its lease does not run."""

    @functools.wraps(method)
    async def run(session: FakeSession, /, *args: P.args, **kwargs: P.kwargs) -> T:
        session._busy += 1
        session._lease_off()
        try:
            return await method(session, *args, **kwargs)
        finally:
            session._busy -= 1
            session._lease_on()

    return run


class FakeSession:
    """A [`LockSession`][pgleaderlock.LockSession] on a
    [`FakeServer`][pgleaderlock.testing.FakeServer], with every optional capability a
    ``LeaderLock`` uses.

    ``wait_lock`` is a wait per call: a wait that times out leaves the queue (the
    contract allows it; the built-in backends keep theirs going between calls).
    ``holds`` asks the server's lock table; ``start_probe`` and ``keep_alive`` check
    only that the session lives.
    """

    def __init__(self, server: FakeServer, pid: int) -> None:
        self._server = server
        self._pid = pid
        self.closed = False
        self.killed = False
        self.aborted = False
        self.info: SessionInfo | None = None
        """What ``identify()`` reported (``None`` before)."""
        self.options: ConnectOptions | None = None
        """What ``configure()`` applied (``None`` before)."""
        self._watch: Callable[[], None] | None = None
        self._leased = False  # granted a lock: idle for lease_s, it ends
        self._busy = 0  # calls in flight
        self._lease: asyncio.TimerHandle | None = None
        self.lease_expired = False
        """The server ended the session for its lease (idle for ``lease_s``)."""

    @property
    def backend_pid(self) -> int | None:
        return self._pid

    def _dead(self, method: str) -> ConnectionError:
        """What a backend raises on a dead session: a ConnectionError whose cause is the
        "driver's" error, as every real backend chains it."""
        cause: builtins.ConnectionError
        if self.lease_expired:
            cause = ConnectionResetError(
                "terminating connection due to idle-session timeout; server closed the "
                "connection unexpectedly"
            )
        elif self.killed:
            cause = ConnectionResetError(
                "terminating connection due to administrator command; server closed the "
                "connection unexpectedly"
            )
        else:
            cause = ConnectionAbortedError("the connection is closed")
        err = ConnectionError(f"{method}: the connection is closed")
        err.__cause__ = cause
        return err

    def _kill(self) -> None:
        if self.killed or self.closed:
            return
        self._lease_off()
        self.killed = True
        self._server._free(self)
        self._fire()  # the FATAL message arrives on the idle socket

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Called back when this session is terminated while idle. On a session that
        already ended, soon after (from the event loop), as a real socket that holds
        the server's FATAL message and EOF reports at once."""
        self._watch = callback
        if callback is not None and (self.killed or self.closed):
            asyncio.get_running_loop().call_soon(self._fire)

    def _fire(self) -> None:
        callback, self._watch = self._watch, None
        if callback is not None:
            callback()

    @property
    def _gone(self) -> bool:
        return self.closed or self.killed

    def _lease_on(self) -> None:
        lease_s = self.options.lease_s if self.options is not None else 0.0
        if (
            self._leased
            and lease_s > 0
            and self._busy == 0
            and not self._gone
            and self._server.lease_supported
        ):
            self._lease_off()
            self._lease = asyncio.get_running_loop().call_later(lease_s, self._lease_ends)

    def _lease_off(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.cancel()

    def _lease_ends(self) -> None:
        self._lease = None
        self._server.calls["lease_expired"] += 1
        self.lease_expired = True
        self._kill()

    async def _enter(self, method: str, *, keep_watch: bool = False) -> None:
        """A call's way in: counted, then hung, delayed or failed as scripted; a call
        on a dead session raises. A statement removes the watch; a probe keeps it."""
        server = self._server
        names = (method, "probe") if method in PROBES else (method,)
        if not keep_watch:
            self._watch = None
        for name in names:
            server.calls[name] += 1
        if method != "try_lock" or not server._grant_then_hang:
            await server._maybe_hang(names, self)
        delay = server._delay(names)
        if delay and not self._gone:
            await asyncio.sleep(delay)
        if self._gone:
            raise self._dead(method)
        server._maybe_fail(names)

    # ------------------------------------------------------------ LockSession

    @_statement
    async def try_lock(self, key1: int, key2: int) -> bool:
        await self._enter("try_lock")
        holds = self._server._holds
        holder = holds.get((key1, key2))
        granted = holder is None or holder[0] is self
        if granted:
            holds[(key1, key2)] = (self, holder[1] + 1 if holder else 1)
            self._leased = True
        if self._server._grant_then_hang:
            await self._server._maybe_hang(("try_lock",), self)
            if self._gone:
                raise self._dead("try_lock")
        return granted

    @_statement
    async def unlock(self, key1: int, key2: int) -> bool:
        await self._enter("unlock")
        holds = self._server._holds
        holder = holds.get((key1, key2))
        if holder is None or holder[0] is not self:
            return False
        if holder[1] > 1:
            holds[(key1, key2)] = (self, holder[1] - 1)
        else:
            del holds[(key1, key2)]
            self._server._grant_next((key1, key2))
        return True

    @_statement
    async def holds(self, key1: int, key2: int) -> bool:
        """The authoritative probe: does the server's lock table give the lock to this
        session? Raises if the session is dead."""
        await self._enter("holds")
        return self._server.holder(key1, key2) is self

    async def close(self) -> None:
        self._watch = None
        self._lease_off()
        self._server.calls["close"] += 1
        if not self.closed:
            self.closed = True
            self._server._free(self)

    # ------------------------------------------------------------ WaitingSession

    @_statement
    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        """Queue for the lock like ``pg_advisory_lock`` under ``lock_timeout``: a wait
        per call, which leaves the queue when it times out."""
        await self._enter("wait_lock")
        server, key = self._server, (key1, key2)
        holder = server._holds.get(key)
        if holder is None or holder[0] is self:
            server._holds[key] = (self, holder[1] + 1 if holder else 1)
            self._leased = True
            return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = (self, future)
        server._waiters.setdefault(key, []).append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                granted = await future
        except TimeoutError:
            # Granted in the same instant as the timeout: the server's answer wins.
            granted = future.done() and not future.cancelled() and future.exception() is None
        finally:
            queue = server._waiters.get(key, [])
            if entry in queue:
                queue.remove(entry)
        if granted:
            self._leased = True
        return granted

    async def wait_lock_once(self, key1: int, key2: int, timeout_s: float) -> bool:
        """`wait_lock` (which here never outlives its call either)."""
        return await self.wait_lock(key1, key2, timeout_s)

    # ------------------------------------------------------------ AbortableSession

    def abort(self) -> None:
        """Drop the "connection" now: the server frees the session's locks, its calls
        in flight fail. Idempotent, never raises."""
        self._server.calls["abort"] += 1
        self.aborted = True
        self._watch = None
        self._lease_off()
        if not self.closed:
            self.closed = True
            self._server._free(self)

    # ------------------------------------------------------------ SetupSession

    @_statement
    async def identify(self, options: ConnectOptions | None = None) -> SessionInfo:
        """Who serves the session: its own pid twice (a direct connection), whether the
        server is a standby (``FakeServer.in_recovery``); later calls answer the same."""
        await self._enter("identify")
        if self.info is None:
            server = self._server
            self.info = SessionInfo(
                self._pid, self._pid, server.in_recovery, server.lease_supported, False
            )
        return self.info

    @_statement
    async def configure(self, options: ConnectOptions) -> None:
        """Record ``options`` (application name, settings, lease) as the session's."""
        await self._enter("configure")
        self.options = options

    @_statement
    async def backend_now(self) -> int:
        await self._enter("backend_now")
        return self._pid

    # ------------------------------------------------------------ probes

    def start_probe(self) -> asyncio.Future[None]:
        """The cheap probe, as a future: it resolves once the session "answers", fails
        with ``ConnectionError`` on a dead session, and leaves the watch armed.
        Scripted as ``"start_probe"`` or ``"probe"``.

        It checks liveness only: after a grant the core asks ``holds()`` first."""
        return asyncio.get_running_loop().create_task(self._probe())

    @_statement
    async def _probe(self) -> None:
        await self._enter("start_probe", keep_watch=True)

    def keep_alive(self) -> asyncio.Future[None] | None:
        """Show the server the client lives: a future of its answer; ``None`` once the
        session was closed."""
        if self.closed:
            return None
        return asyncio.get_running_loop().create_task(self._answer("keep_alive"))

    @_statement
    async def _answer(self, method: str) -> None:
        await self._enter(method, keep_watch=True)

    def acknowledged(self) -> bool | None:
        """Has the "network" acknowledged what the session sent? Scripted with
        ``FakeServer.acknowledged``."""
        self._server.calls["acknowledged"] += 1
        return self._server.acknowledged

    # ------------------------------------------------------------ tables and fencing

    @_statement
    async def prepare_table(self, table: LibraryTable) -> None:
        """The table check: recorded in ``FakeServer.table_checks`` at every call;
        raises the table's entry in ``FakeServer.table_errors``, if any."""
        await self._enter("prepare_table")
        self._server.table_checks.append((self, table))
        self._server._table_error(table)

    @_statement
    async def bump_term(self, table: TermTable, key1: int, key2: int, wait_s: float) -> int | None:
        """Increment the lock's term: ``max(old + 1, timeline << 32 | 1)``, returned with
        the old one (a ``BumpedTerm``), after every fenced transaction that holds the row
        has ended, waiting at most ``wait_s`` for them (``None`` after that, nothing
        changed)."""
        await self._enter("bump_term")
        server, key = self._server, (key1, key2)
        server._table_error(table)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while server._blocking(table.shown, key, self):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):
                    await server._next_change()
            except TimeoutError:
                pass
            if self._gone:
                raise self._dead("bump_term")
        prior = server._terms.get((table.shown, key))
        term = max((prior or 0) + 1, server.timeline << 32 | 1)
        server._terms[(table.shown, key)] = term
        return BumpedTerm(term, prior)

    @_statement
    async def end_fenced(self, table: TermTable, keys: list[tuple[int, int]]) -> FencedSessions:
        """End the fenced transactions of ``keys`` that hold their rows (and their
        sessions); those not ``endable`` are reported as refused."""
        await self._enter("end_fenced")
        server = self._server
        server._table_error(table)
        ended: list[int] = []
        refused: list[tuple[int, str]] = []
        for key in keys:
            for txn in server._blocking(table.shown, key, self):
                if not txn.endable:
                    refused.append((txn.pid, txn.role))
                    continue
                ended.append(txn.pid)
                if txn.session is not None:
                    txn.session._kill()
                txn.end()
        return FencedSessions(tuple(ended), tuple(refused))

    def __repr__(self) -> str:
        return f"<FakeSession pid={self._pid} closed={self.closed} killed={self.killed}>"
