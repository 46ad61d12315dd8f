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

A [`FakeSession`][pgleaderlock.testing.FakeSession] (its own module, `fake_session`,
importable from here) has every session capability a ``LeaderLock`` uses (see
[`pgleaderlock.backends`][pgleaderlock.backends]): it waits, is watched, aborted,
identified and configured, probes as a future, keeps alive, tells whether the "network"
acknowledged its data, and bumps fencing terms.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

from ..lowlevel import DEFAULT_SCHEMA, LibraryTable
from .fake_session import PROBES as PROBES
from .fake_session import FakeSession

__all__ = ["FakeServer", "FakeSession", "FencedTransaction"]

Key = tuple[int, int]

TERMS = f"{DEFAULT_SCHEMA}.pgleaderlock_terms"
"""The default fencing table's qualified name (``fencing_table``, ``fencing_schema``)."""

E = TypeVar("E")


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


async def _listed_while_waiting(waiting: list[E], entry: E, future: asyncio.Future[None]) -> None:
    """Await ``future`` with ``entry`` in ``waiting`` meanwhile (where scripting finds
    it: a hung call to release, a waiter to wake)."""
    waiting.append(entry)
    try:
        await future
    finally:
        if entry in waiting:
            waiting.remove(entry)
