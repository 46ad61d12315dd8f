"""An in-memory stand-in for PostgreSQL's advisory locks, for tests without a server.

``FakeServer`` models session-level advisory locks (exclusive, re-entrant per session,
freed when the session ends) and lets a test script failures: refuse connections,
terminate a session, make a call hang, grant a lock and then hang (the reply "lost on
the wire"). ``FakeServer.connect`` is a ready-made ``connect_fn``:

```python
server = FakeServer()
lock = LeaderLock(None, 1, 2, connect_fn=server.connect)
```
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
from collections import Counter
from collections.abc import Callable

from ..core.errors import ConnectionError

__all__ = ["FakeServer", "FakeSession"]

Key = tuple[int, int]


class FakeServer:
    """Advisory-lock semantics of one PostgreSQL server, in memory."""

    def __init__(self) -> None:
        self.sessions: list[FakeSession] = []
        self.refuse_connections: Exception | None = None
        """When set, ``connect()`` raises it."""
        self.fail_calls: dict[str, Exception] = {}
        """Method name -> exception raised by the next call of that method (once)."""
        self._hang: set[str] = set()
        self._grant_then_hang = False
        self._gate = asyncio.Event()
        self._holds: dict[Key, tuple[FakeSession, int]] = {}
        self._waiters: dict[Key, list[tuple[FakeSession, asyncio.Future[bool]]]] = {}
        self._pids = itertools.count(1000)
        self.calls: Counter[str] = Counter()

    # --------------------------------------------------------------- scripting

    async def connect(self) -> FakeSession:
        """A ``connect_fn``: opens a new session (or raises ``refuse_connections``)."""
        self.calls["connect"] += 1
        await self._maybe_hang("connect")
        if self.refuse_connections is not None:
            raise self.refuse_connections
        session = FakeSession(self, next(self._pids))
        self.sessions.append(session)
        return session

    def hang(self, *methods: str, grant_first: bool = False) -> None:
        """Make calls of ``methods`` block until
        [`release_hangs`][pgleaderlock.testing.FakeServer.release_hangs].

        With ``grant_first``, ``try_lock`` takes the lock on the server before hanging:
        the client never learns that it was granted.
        """
        self._hang.update(methods)
        self._grant_then_hang = grant_first
        self._gate.clear()

    def release_hangs(self) -> None:
        self._hang.clear()
        self._grant_then_hang = False
        self._gate.set()

    def terminate(self, session: FakeSession | None = None) -> None:
        """Like ``pg_terminate_backend``: kill ``session`` (default: the lock holder)."""
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

    @property
    def open_sessions(self) -> list[FakeSession]:
        return [s for s in self.sessions if not s.closed]

    # --------------------------------------------------------------- internals

    async def _maybe_hang(self, method: str) -> None:
        if method in self._hang:
            await self._gate.wait()

    def _maybe_fail(self, method: str) -> None:
        exc = self.fail_calls.pop(method, None)
        if exc is not None:
            raise exc

    def _free(self, session: FakeSession) -> None:
        for key, (holder, _) in list(self._holds.items()):
            if holder is session:
                del self._holds[key]
                self._grant_next(key)
        for queue in self._waiters.values():
            for waiter, future in queue:
                if waiter is session and not future.done():
                    future.set_exception(session._dead("wait_lock"))

    def _grant_next(self, key: Key) -> None:
        """Like PostgreSQL: a freed lock goes at once to the first waiter in the queue."""
        queue = self._waiters.get(key, [])
        while queue:
            waiter, future = queue.pop(0)
            if not future.done() and not (waiter.closed or waiter.killed):
                self._holds[key] = (waiter, 1)
                future.set_result(True)
                return


class FakeSession:
    """A [`LockSession`][pgleaderlock.LockSession] on a
    [`FakeServer`][pgleaderlock.testing.FakeServer]."""

    def __init__(self, server: FakeServer, pid: int) -> None:
        self._server = server
        self._pid = pid
        self.closed = False
        self.killed = False
        self._watch: Callable[[], None] | None = None

    @property
    def backend_pid(self) -> int | None:
        return self._pid

    def _dead(self, method: str) -> ConnectionError:
        """What a backend raises on a dead session: a ConnectionError whose cause is the
        "driver's" error, as every real backend chains it."""
        cause: builtins.ConnectionError
        if self.killed:
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

    async def _enter(self, method: str) -> None:
        self._watch = None
        self._server.calls[method] += 1
        if method != "try_lock" or not self._server._grant_then_hang:
            await self._server._maybe_hang(method)
        if self.closed or self.killed:
            raise self._dead(method)
        self._server._maybe_fail(method)

    async def try_lock(self, key1: int, key2: int) -> bool:
        await self._enter("try_lock")
        holds = self._server._holds
        holder = holds.get((key1, key2))
        granted = holder is None or holder[0] is self
        if granted:
            holds[(key1, key2)] = (self, holder[1] + 1 if holder else 1)
        if self._server._grant_then_hang:
            await self._server._maybe_hang("try_lock")
        return granted

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        """Queue for the lock like ``pg_advisory_lock`` under ``lock_timeout``."""
        await self._enter("wait_lock")
        server, key = self._server, (key1, key2)
        holder = server._holds.get(key)
        if holder is None or holder[0] is self:
            server._holds[key] = (self, holder[1] + 1 if holder else 1)
            return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = (self, future)
        server._waiters.setdefault(key, []).append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            # Granted in the same instant as the timeout: the server's answer wins.
            return future.done() and not future.cancelled() and future.exception() is None
        finally:
            queue = server._waiters.get(key, [])
            if entry in queue:
                queue.remove(entry)

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

    async def holds(self, key1: int, key2: int) -> bool:
        await self._enter("holds")
        return self._server.holder(key1, key2) is self

    async def close(self) -> None:
        self._watch = None
        self._server.calls["close"] += 1
        self.closed = True
        self._server._free(self)

    def __repr__(self) -> str:
        return f"<FakeSession pid={self._pid} closed={self.closed} killed={self.killed}>"
