"""An in-memory stand-in for PostgreSQL's advisory locks, for tests without a server.

``FakeServer`` models session-level advisory locks (exclusive, re-entrant per session,
freed when the session ends), the fencing terms a ``fencing=True`` lock keeps, and lets
a test script failures: refuse connections, terminate a session, make a call hang or
fail, grant a lock and then hang (the reply "lost on the wire"), make a probe slow,
refuse the library's table, keep an old fenced transaction open on a term's row.
``FakeServer.connect`` is a ready-made ``connect_fn``:

```python
server = FakeServer()
lock = LeaderLock(None, 1, 2, connect_fn=server.connect)
```

A [`FakeSession`][pgleaderlock.testing.FakeSession] has every session capability a
``LeaderLock`` uses (see [`pgleaderlock.backends`][pgleaderlock.backends]): it waits,
is watched, aborted, identified and configured, probes as a future, keeps alive, tells
whether the "network" acknowledged its data, and bumps fencing terms.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import itertools
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..core.errors import ConnectionError
from ..core.session import ConnectOptions, FencedSessions, SessionInfo
from ..core.tables import DEFAULT_SCHEMA, LibraryTable, TermTable

__all__ = ["FakeServer", "FakeSession", "FencedTransaction"]

Key = tuple[int, int]

TERMS = f"{DEFAULT_SCHEMA}.pgleaderlock_terms"
"""The default fencing table's qualified name (``fencing_table``, ``fencing_schema``)."""

P = ParamSpec("P")
T = TypeVar("T")
E = TypeVar("E")

PROBES = ("holds", "start_probe")
"""The session methods that ``"probe"`` stands for in ``calls``, ``fail_calls``,
``hang()`` and ``delays``: whichever health probe the lock makes."""


@dataclass(eq=False)
class FencedTransaction:
    """A transaction that passed ``fence()`` for a lock and still holds its term row
    (``FOR SHARE``): it keeps every bump of that lock's term waiting until it ends.

    Made by [`FakeServer.fenced_transaction`][pgleaderlock.testing.FakeServer.fenced_transaction].
    """

    server: FakeServer = field(repr=False)
    table: str
    key: Key
    term: int | None
    """The term it was fenced under (``None``: the lock had no term yet)."""
    pid: int
    role: str
    endable: bool
    """Whether the lock's role may end its session (``end_fenced``)."""
    session: FakeSession | None = field(default=None, repr=False)
    ended: bool = False

    def end(self) -> None:
        """The transaction commits or rolls back: the row is free."""
        if not self.ended:
            self.ended = True
            self.server._changed()


class FakeServer:
    """Advisory-lock semantics of one PostgreSQL server, in memory."""

    def __init__(self) -> None:
        self.sessions: list[FakeSession] = []
        self.refuse_connections: Exception | None = None
        """When set, ``connect()`` raises it."""
        self.fail_calls: dict[str, Exception] = {}
        """Method name -> exception raised by the next call of that method (once).
        ``"probe"`` fails the next health probe, ``holds`` or ``start_probe``."""
        self.delays: dict[str, float] = {}
        """Method name (or ``"probe"``) -> seconds every call of it takes."""
        self.acknowledged: bool | None = None
        """What every session's ``acknowledged()`` answers when a probe is late: True
        (the server has the probe: slow, not lost), False, or None (cannot tell)."""
        self.in_recovery = False
        """The server is a standby: ``identify()`` says so (the lock refuses it)."""
        self.lease_supported = True
        """What ``identify()`` reports as ``SessionInfo.lease_supported``: the server
        ends a session that was granted a lock and then stays idle (no call in flight)
        for ``lease_s`` (``configure()``'s options), as ``idle_session_timeout`` does."""
        self.timeline = 1
        """The server's timeline: the high 32 bits of a lock's first term."""
        self.table_errors: dict[str, Exception] = {}
        """Qualified table name (``"public.pgleaderlock_terms"``) -> the exception every
        ``prepare_table`` of that table raises, and every term bump or ``end_fenced`` on
        it (an ``UntrustedObjectError`` or a ``MissingPrivilegeError``), until removed."""
        self.table_checks: list[tuple[FakeSession, LibraryTable]] = []
        """Every ``prepare_table`` call, in order: the session and the table."""
        self.calls: Counter[str] = Counter()
        """Calls per method name; ``"probe"`` counts ``holds`` and ``start_probe``."""
        self._hang: set[str] = set()
        self._hung: list[tuple[FakeSession | None, asyncio.Future[None]]] = []
        self._grant_then_hang = False
        self._holds: dict[Key, tuple[FakeSession, int]] = {}
        self._waiters: dict[Key, list[tuple[FakeSession, asyncio.Future[bool]]]] = {}
        self._terms: dict[tuple[str, Key], int] = {}
        self._fenced: list[FencedTransaction] = []
        self._changes: list[asyncio.Future[None]] = []
        self._pids = itertools.count(1000)

    # --------------------------------------------------------------- scripting

    async def connect(self) -> FakeSession:
        """A ``connect_fn``: opens a new session (or raises ``refuse_connections``)."""
        self.calls["connect"] += 1
        await self._maybe_hang(("connect",), None)
        if self.refuse_connections is not None:
            raise self.refuse_connections
        session = FakeSession(self, next(self._pids))
        self.sessions.append(session)
        return session

    def hang(self, *methods: str, grant_first: bool = False) -> None:
        """Make calls of ``methods`` block until
        [`release_hangs`][pgleaderlock.testing.FakeServer.release_hangs] (or until their
        session ends: then they fail, as on a real server). ``"probe"`` hangs both
        health probes: a ``start_probe`` future stays pending.

        With ``grant_first``, ``try_lock`` takes the lock on the server before hanging:
        the client never learns that it was granted.
        """
        self._hang.update(methods)
        self._grant_then_hang = grant_first

    def release_hangs(self) -> None:
        self._hang.clear()
        self._grant_then_hang = False
        hung, self._hung = self._hung, []
        for _, future in hung:
            if not future.done():
                future.set_result(None)

    def terminate(self, session: FakeSession | None = None) -> None:
        """Like ``pg_terminate_backend``: kill ``session`` (default: the lock holder).
        Its locks are freed, its calls in flight fail, its watch fires."""
        targets = [s for s, _ in self._holds.values()] if session is None else [session]
        for target in targets:
            target._kill()

    def holder(self, key1: int, key2: int) -> FakeSession | None:
        entry = self._holds.get((key1, key2))
        return entry[0] if entry else None

    def hold_count(self, key1: int, key2: int) -> int:
        """How many times the holder has taken the lock (re-entrancy)."""
        entry = self._holds.get((key1, key2))
        return entry[1] if entry else 0

    def term(self, key1: int, key2: int, table: str = TERMS) -> int | None:
        """The lock's fencing term in ``table`` (qualified name), ``None`` before the
        first bump."""
        return self._terms.get((table, (key1, key2)))

    def fenced_transaction(
        self,
        key1: int,
        key2: int,
        *,
        table: str = TERMS,
        role: str = "app",
        endable: bool = True,
        session: FakeSession | None = None,
    ) -> FencedTransaction:
        """Open a transaction that passed ``fence()`` under the lock's current term and
        holds its term row: a frozen or partitioned old leader's. Every term bump of the
        lock waits for it (and returns ``None`` after its wait) until it
        [`end`][pgleaderlock.testing.fake.FencedTransaction.end]s, its ``session`` (if
        given) ends, or ``end_fenced`` ends it; ``endable=False``: ``end_fenced`` may
        not (another role's session), and reports it as refused."""
        pid = session.backend_pid if session is not None else None
        txn = FencedTransaction(
            self,
            table,
            (key1, key2),
            self.term(key1, key2, table),
            pid if pid is not None else next(self._pids),
            role,
            endable,
            session,
        )
        self._fenced.append(txn)
        return txn

    @property
    def fenced(self) -> list[FencedTransaction]:
        """The fenced transactions still open."""
        return [t for t in self._fenced if not t.ended]

    @property
    def open_sessions(self) -> list[FakeSession]:
        return [s for s in self.sessions if not s.closed]

    # --------------------------------------------------------------- internals

    def _hangs(self, names: tuple[str, ...]) -> bool:
        return any(name in self._hang for name in names)

    async def _maybe_hang(self, names: tuple[str, ...], session: FakeSession | None) -> None:
        if not self._hangs(names):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await _listed_while_waiting(self._hung, (session, future), future)

    def _maybe_fail(self, names: tuple[str, ...]) -> None:
        for name in names:
            exc = self.fail_calls.pop(name, None)
            if exc is not None:
                raise exc

    def _delay(self, names: tuple[str, ...]) -> float:
        return next((self.delays[name] for name in names if name in self.delays), 0.0)

    def _table_error(self, table: LibraryTable) -> None:
        exc = self.table_errors.get(table.shown)
        if exc is not None:
            raise exc

    def _changed(self) -> None:
        """Wake whatever waits for a row or a session to end."""
        changes, self._changes = self._changes, []
        for future in changes:
            if not future.done():
                future.set_result(None)

    async def _next_change(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await _listed_while_waiting(self._changes, future, future)

    def _blocking(self, table: str, key: Key, session: FakeSession) -> list[FencedTransaction]:
        return [
            t
            for t in self._fenced
            if not t.ended and t.table == table and t.key == key and t.session is not session
        ]

    def _free(self, session: FakeSession) -> None:
        """The session ended: its locks, waits, calls in flight and fenced transactions
        go with it."""
        for key, (holder, _) in list(self._holds.items()):
            if holder is session:
                del self._holds[key]
                self._grant_next(key)
        for queue in self._waiters.values():
            for waiter, future in queue:
                if waiter is session and not future.done():
                    future.set_exception(session._dead("wait_lock"))
        for owner, hung in list(self._hung):
            if owner is session and not hung.done():
                hung.set_result(None)  # the call wakes to a dead session and fails
        for txn in self._fenced:
            if txn.session is session:
                txn.ended = True
        self._changed()

    def _grant_next(self, key: Key) -> None:
        """Like PostgreSQL: a freed lock goes at once to the first waiter in the queue."""
        queue = self._waiters.get(key, [])
        while queue:
            waiter, future = queue.pop(0)
            if not future.done() and not (waiter.closed or waiter.killed):
                self._holds[key] = (waiter, 1)
                future.set_result(True)
                return


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
        """Increment the lock's term: ``max(old + 1, timeline << 32 | 1)``, after every
        fenced transaction that holds the row has ended, waiting at most ``wait_s`` for
        them (``None`` after that, nothing changed)."""
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
        old = server._terms.get((table.shown, key), 0)
        term = max(old + 1, server.timeline << 32 | 1)
        server._terms[(table.shown, key)] = term
        return term

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


async def _listed_while_waiting(waiting: list[E], entry: E, future: asyncio.Future[None]) -> None:
    """Await ``future`` with ``entry`` in ``waiting`` meanwhile (where scripting finds
    it: a hung call to release, a waiter to wake)."""
    waiting.append(entry)
    try:
        await future
    finally:
        if entry in waiting:
            waiting.remove(entry)
