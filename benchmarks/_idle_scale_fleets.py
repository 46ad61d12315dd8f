"""What a worker process of ``idle_scale.py`` holds: N sessions of one implementation,
the library's (``LibraryFleet``: ``LeaderLock``s, leaders or followers) or raw psycopg
sessions (``RawFleet``: blocking waiters, with a ping or a probe of their own), and the
counts of their events.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from pgleaderlock import LockOptions, Session

HEALTH_INTERVAL_S = 5.0  # the library's default: probes expected = N * window / this


class _EventCounter(logging.Handler):
    """Counts the library's log records by event (``record.pgleaderlock["event"]``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events = collections.Counter[str]()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "pgleaderlock", None)
        event = fields.get("event") if isinstance(fields, dict) else None
        self.events[str(event or record.msg)[:60]] += 1


class LibraryFleet:
    """N ``LeaderLock`` s of the library on PYTHONPATH, default settings; with
    ``connect_fn``, each opens its session through a ``connect_fn`` that returns the
    driver's own connection (``psycopg.AsyncConnection.connect`` / ``asyncpg.connect``)."""

    def __init__(
        self, role: str, dsn: str, names: Sequence[str], backend: str, connect_fn: bool = False
    ) -> None:
        from pgleaderlock import LeaderLock

        self.role = role
        self.counter = _EventCounter()
        library_log = logging.getLogger("pgleaderlock")
        library_log.setLevel(logging.INFO)
        library_log.addHandler(self.counter)
        self.lost = self.demotions = self.acquired = 0
        self.errors = collections.Counter[str]()
        self.acquired_at: dict[int, float] = {}
        no_plugins = LockOptions(session=Session(backend=backend), load_plugins=False)
        options: dict[str, Any] = {"dsn": dsn, "options": no_plugins}
        if connect_fn:

            async def connect() -> Any:
                if backend == "asyncpg":
                    import asyncpg

                    return await asyncpg.connect(dsn, timeout=60)
                return await psycopg.AsyncConnection.connect(dsn, connect_timeout=60)

            options = {"dsn": None, "connect_fn": connect, "options": no_plugins}
        self.locks = [LeaderLock.from_name(name, **options) for name in names]
        for index, lock in enumerate(self.locks):
            lock.on_lost(self._on_lost)
            lock.on_state_change(self._on_state_change)
            lock.on_acquired(lambda index=index: self._on_acquired(index))  # type: ignore[misc]
            lock.on_error(self._on_error)

    def _on_lost(self) -> None:
        self.lost += 1

    def _on_state_change(self, old: Any, new: Any) -> None:
        if getattr(old, "name", "") == "LEADER":
            self.demotions += 1

    def _on_acquired(self, index: int) -> None:
        self.acquired += 1
        self.acquired_at.setdefault(index, time.monotonic())

    def _on_error(self, error: Exception) -> None:
        self.errors[type(error).__name__] += 1

    async def start(self, timeout_s: float) -> None:
        await asyncio.gather(*(lock.start() for lock in self.locks))
        deadline = time.monotonic() + timeout_s
        if self.role == "leaders":
            await asyncio.gather(
                *(lock.wait_for_leadership(timeout_s) for lock in self.locks),
                return_exceptions=True,
            )
            return
        # A follower is in place once its first attempt found the lock taken (it then
        # waits on the server).
        while time.monotonic() < deadline:
            if all(lock.is_leader or lock.statistics().failed_attempts > 0 for lock in self.locks):
                return
            await asyncio.sleep(0.1)

    def pids(self) -> list[int]:
        return [pid for lock in self.locks if (pid := lock.backend_pid) is not None]

    def counters(self) -> dict[str, Any]:
        stats = [lock.statistics() for lock in self.locks]
        states = collections.Counter(getattr(s.state, "name", str(s.state)) for s in stats)
        return {
            "leading": sum(lock.is_leader for lock in self.locks),
            "lost": self.lost,
            "demotions": self.demotions,
            "acquired": self.acquired,
            "losses": sum(s.losses for s in stats),
            "transitions": sum(s.transitions for s in stats),
            # statistics().probes is newer than the first versions measured here
            "probes": sum(getattr(s, "probes", 0) for s in stats),
            "errors": dict(self.errors),
            "states": dict(states),
            "events": dict(self.counter.events),
        }

    async def stop(self) -> None:
        await asyncio.gather(
            *(lock.shutdown(timeout_s=30) for lock in self.locks), return_exceptions=True
        )


# The library's periodic probe (backends/base.py ALIVE), for the raw-probe variant.
RAW_PROBE = (
    "SELECT true, pg_is_in_recovery(), current_setting('pgleaderlock.session', true),"
    " pg_backend_pid()"
)


RAW_PING_GRID_S = 0.1  # as the library's probe times (core/machine/engine.py PROBE_GRID_S)


class RawFleet:
    """N raw driver sessions: leaders take the lock once and idle (or, with
    ``probe_every_s``, run ``RAW_PROBE`` that often, from a random phase; with ``ping``,
    send a bare protocol Sync instead, psycopg only: the library's probe, hand-written
    as lean as it gets); followers are queued in ``pg_advisory_lock`` (psycopg: sent
    without waiting, the socket watched by the event loop, so the client does nothing
    until the grant arrives)."""

    def __init__(
        self,
        role: str,
        dsn: str,
        names: Sequence[str],
        backend: str,
        probe_every_s: float = 0,
        ping: bool = False,
    ) -> None:
        from pgleaderlock import lock_keys

        self.role, self.dsn, self.backend = role, dsn, backend
        self.probe_every_s, self.ping = probe_every_s, ping
        self.probes = 0
        self.keys = [lock_keys(name) for name in names]
        self.conns: list[Any] = []
        self.acquired_at: dict[int, float] = {}
        self.errors = collections.Counter[str]()
        self.tasks: list[asyncio.Task[None]] = []
        self.timers: collections.deque[asyncio.TimerHandle] = collections.deque(
            maxlen=4 * len(names) + 16
        )
        self.app = f"idle-scale-raw-{role}"

    async def _connect(self) -> Any:
        if self.backend == "asyncpg":
            import asyncpg

            return await asyncpg.connect(
                self.dsn, timeout=60, server_settings={"application_name": self.app}
            )
        return await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, application_name=self.app, connect_timeout=60
        )

    async def _lead(self, key1: int, key2: int) -> Any:
        conn = await self._connect()
        sql = f"SELECT pg_try_advisory_lock(({key1})::int4, ({key2})::int4)"
        if self.backend == "asyncpg":
            granted = await conn.fetchval(sql)
        else:
            row = await (await conn.execute(sql.encode())).fetchone()
            granted = bool(row and row[0])
        if not granted:
            self.errors["not granted"] += 1
        return conn

    async def start(self, timeout_s: float) -> None:
        if self.role == "leaders":
            self.conns = list(
                await asyncio.wait_for(
                    asyncio.gather(*(self._lead(*keys) for keys in self.keys)), timeout_s
                )
            )
            if self.ping:
                for conn in self.conns:
                    self._ping_psycopg(conn)
            elif self.probe_every_s > 0:
                self.tasks = [asyncio.create_task(self._probe(conn)) for conn in self.conns]
            return
        self.conns = list(
            await asyncio.wait_for(asyncio.gather(*(self._connect() for _ in self.keys)), timeout_s)
        )
        for index, (conn, (key1, key2)) in enumerate(zip(self.conns, self.keys, strict=True)):
            sql = f"SELECT pg_advisory_lock(({key1})::int4, ({key2})::int4)"
            if self.backend == "asyncpg":
                self.tasks.append(asyncio.create_task(self._wait_asyncpg(index, conn, sql)))
            else:
                self._wait_psycopg(index, conn, sql.encode())

    def _wait_psycopg(self, index: int, conn: Any, sql: bytes) -> None:
        loop = asyncio.get_running_loop()
        pgconn = conn.pgconn
        fd = pgconn.socket
        pgconn.send_query(sql)
        while pgconn.flush():  # a few dozen bytes: never more than one pass in practice
            pass

        def readable() -> None:
            try:
                pgconn.consume_input()
            except psycopg.Error:
                loop.remove_reader(fd)
                self.errors["connection"] += 1
                return
            if pgconn.is_busy():
                return
            loop.remove_reader(fd)
            self.acquired_at[index] = time.monotonic()
            while pgconn.get_result() is not None:
                pass

        loop.add_reader(fd, readable)

    def _ping_psycopg(self, conn: Any) -> None:
        """Every ``probe_every_s`` (first at a random phase, on the library's 0.1 s
        grid): a Sync in pipeline mode, its answer read by a reader that stays on the
        event loop; no task, no future, no state machine."""
        loop = asyncio.get_running_loop()
        pgconn, every = conn.pgconn, self.probe_every_s

        def send() -> None:
            self.timers.append(loop.call_at(loop.time() + every, send))
            try:
                pgconn.enter_pipeline_mode()
                pgconn.pipeline_sync()
                pgconn.flush()
            except psycopg.Error:
                self.errors["ping"] += 1

        def readable() -> None:
            try:
                pgconn.consume_input()
                if pgconn.is_busy():
                    return
                pgconn.get_result()
                pgconn.exit_pipeline_mode()
            except psycopg.Error:
                loop.remove_reader(pgconn.socket)
                self.errors["ping"] += 1
                return
            self.probes += 1

        loop.add_reader(pgconn.socket, readable)
        # The library's schedule: a random first phase, rounded down to a 0.1 s grid so
        # that the probes of one step share the event loop's wake-ups, then every 5 s.
        first = loop.time() + random.uniform(0.1, 1.0) * every
        self.timers.append(loop.call_at(first - first % RAW_PING_GRID_S, send))

    async def _probe(self, conn: Any) -> None:
        every = self.probe_every_s
        await asyncio.sleep(random.uniform(0.1, 1.0) * every)
        while True:
            async with asyncio.timeout(2.0):
                if self.backend == "asyncpg":
                    await conn.fetchrow(RAW_PROBE)
                else:
                    await (await conn.execute(RAW_PROBE.encode())).fetchone()
            self.probes += 1
            await asyncio.sleep(every)

    async def _wait_asyncpg(self, index: int, conn: Any, sql: str) -> None:
        try:
            await conn.fetchval(sql)
        except Exception as exc:
            self.errors[type(exc).__name__] += 1
            return
        self.acquired_at[index] = time.monotonic()

    def pids(self) -> list[int]:
        if self.backend == "asyncpg":
            return [conn.get_server_pid() for conn in self.conns]
        return [conn.info.backend_pid for conn in self.conns]

    def counters(self) -> dict[str, Any]:
        leading = len(self.conns) if self.role == "leaders" else len(self.acquired_at)
        return {
            "leading": leading,
            "lost": 0,
            "demotions": 0,
            "acquired": len(self.acquired_at),
            "errors": dict(self.errors),
            "events": {"raw_probes": self.probes} if self.probe_every_s else {},
            "probes": self.probes if self.ping else 0,  # else counted by the server
        }

    async def stop(self) -> None:
        for timer in self.timers:
            timer.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                if self.backend == "asyncpg":
                    conn.terminate()
                else:
                    if not conn.closed:
                        with contextlib.suppress(Exception):
                            asyncio.get_running_loop().remove_reader(conn.pgconn.socket)
                    await conn.close()
