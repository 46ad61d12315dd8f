"""The dashboard's one reader of the database: however many pages are open, the app
holds two sessions and reads one snapshot per refresh.

- a *read* session (psycopg, sync, on one worker thread): each refresh is one
  read-only transaction (``BEGIN READ ONLY``) whose statements run under a statement
  timeout and a safe ``search_path`` (`pgleaderlock.status.bounded`); the session is
  opened again after an error;
- a *listening* session, ``LISTEN pgleaderlock_leader``: every lock that starts to
  lead says so on that channel (`pgleaderlock.lowlevel.LEADER_CHANNEL`, the leader
  watch's), and a notification makes a refresh at once.

It refreshes on a notification and at least every ``period_s`` (a leader that died
with nobody to follow it announces nothing), never more often than every
``min_gap_s``: a flood of ``NOTIFY``s (any role may send them) costs at most
``1 / min_gap_s`` refreshes a second. Each result goes to the `Hub`, which the pages
follow. ``statements`` counts every statement the app sent, ``refreshes`` the
snapshots read: the page shows both, and the tests hold the count to the refreshes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from ..lowlevel import LEADER_CHANNEL, ConfigurationError, get_logger, without_driver
from ..status import bounded
from ..status.render import fingerprint, json_default
from .hub import Hub
from .snapshot import History, Tables, build_snapshot, safe_error

__all__ = ["APPLICATION_NAME", "Refresher"]

log = get_logger("pgleaderlock.dashboard")

APPLICATION_NAME = "pgleaderlock-dashboard"
"""The ``application_name`` of the dashboard's sessions."""


class _Counted:
    """How many statements the read session sent (every ``execute`` of its cursors)."""

    def __init__(self) -> None:
        self.statements = 0

    def cursor_class(self) -> type[psycopg.Cursor[Any]]:
        counter = self

        class CountingCursor(psycopg.Cursor[Any]):
            def execute(self, *args: Any, **kwargs: Any) -> Any:
                counter.statements += 1
                return super().execute(*args, **kwargs)

        return CountingCursor


class Refresher:
    """Reads the snapshot for every page of one app, and publishes it to ``hub``.

    Args:
        dsn: the database (a ``postgresql+DRIVER://`` scheme is accepted; the dashboard
            reads with psycopg). It is never shown.
        tables: the library's tables and the trusted roles.
        period_s: the longest time between two refreshes (at most 1 s).
        timeout_s: the bound of a connect and of each statement; a refresh as a whole
            is abandoned after ``2 * timeout_s``.
        min_gap_s: the shortest time between two refreshes.
        max_clients: the most pages that may follow it at once.
    """

    def __init__(
        self,
        dsn: str,
        tables: Tables,
        *,
        period_s: float = 1.0,
        timeout_s: float = 5.0,
        min_gap_s: float = 0.05,
        max_clients: int = 100,
    ) -> None:
        if not 0 < period_s <= 1.0:
            raise ConfigurationError(f"period_s must be > 0 and <= 1 s, got {period_s!r}")
        if not 0 < timeout_s <= 300:
            raise ConfigurationError(f"timeout_s must be > 0 and <= 300 s, got {timeout_s!r}")
        if not 0 < min_gap_s <= period_s:
            raise ConfigurationError(f"min_gap_s must be > 0 and <= period_s, got {min_gap_s!r}")
        self._dsn = without_driver(dsn)
        self.tables = tables
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.min_gap_s = min_gap_s
        self.hub = Hub(max_clients)
        self.refreshes = 0
        self.transactions = 0
        """The read transactions begun (a refresh cut short by a stop is one too)."""
        self.connections = 0
        """The sessions opened (both kinds; again after an error)."""
        self.listening = False
        self._counted = _Counted()
        self._listen_statements = 0
        self._history = History()
        self._conn: psycopg.Connection[Any] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._poked = asyncio.Event()
        self._inflight: asyncio.Future[Any] | None = None
        self._listen_conn: psycopg.AsyncConnection[Any] | None = None

    @property
    def statements(self) -> int:
        """Every query the app sent to the server so far (each refresh's transaction
        control, ``BEGIN``/``SAVEPOINT``/``RELEASE``/``COMMIT``, aside)."""
        return self._counted.statements + self._listen_statements

    @property
    def server_transactions(self) -> int:
        """The transactions the server counts for the app (``pg_stat_database``): one
        per refresh, the ``LISTEN`` (autocommit), and one per session it opened (the
        server's own, as the session starts)."""
        return self.transactions + self._listen_statements + self.connections

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    async def start(self) -> None:
        """Start refreshing (the first snapshot is read before this returns, or its
        error published)."""
        if self._tasks:
            return
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pgleaderlock-dashboard")
        self.hub.closed = False
        await self._refresh()
        self._tasks = [
            asyncio.create_task(self._loop(), name="pgleaderlock-dashboard-refresh"),
            asyncio.create_task(self._listen(), name="pgleaderlock-dashboard-listen"),
        ]

    async def stop(self) -> None:
        """End every stream, cancel and await the tasks, close both sessions."""
        self.hub.close()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            conn = self._conn
            if conn is not None:  # the statement in flight ends now, not at its timeout
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(conn.cancel_safe, timeout=self.timeout_s)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(inflight), 2 * self.timeout_s)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.submit(self._close)
            await asyncio.to_thread(executor.shutdown, wait=True)

    async def __aenter__(self) -> Refresher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ refreshing

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), self.period_s)
            gap = self.min_gap_s - (loop.time() - last)
            if gap > 0:
                await asyncio.sleep(gap)
            last = loop.time()
            await self._refresh()

    async def _refresh(self) -> None:
        """One snapshot, published (or the error that kept it from being read)."""
        self._poked.clear()  # a notification from now on makes another refresh
        assert self._executor is not None
        started = time.monotonic()
        snapshot_json = mark = error = None
        if self._inflight is not None and not self._inflight.done():
            error = "the last refresh has not ended yet"
        else:
            loop = asyncio.get_running_loop()
            self._inflight = loop.run_in_executor(self._executor, self._read)
            try:
                snapshot = await asyncio.wait_for(
                    asyncio.shield(self._inflight), 2 * self.timeout_s
                )
                mark = fingerprint(snapshot)
                snapshot_json = json.dumps(snapshot, default=json_default)
            except TimeoutError:
                error = f"the refresh took longer than {2 * self.timeout_s:g} s"
            except Exception as exc:
                error = safe_error(exc)
                log.warning("dashboard_refresh_failed", error=error, lock=APPLICATION_NAME)
        self.refreshes += 1
        tick = {
            "seq": self.refreshes,
            "at": datetime.now().astimezone().isoformat(),
            "refresh_ms": round((time.monotonic() - started) * 1000, 1),
            "refreshes": self.refreshes,
            "statements": self.statements,
            "listening": self.listening,
            "period_s": self.period_s,
            "error": error,
        }
        self.hub.publish(snapshot_json, mark, tick)

    def _read(self) -> dict[str, Any]:
        """On the worker thread: the snapshot, on the read session (opened if need be;
        dropped after an error, so the next refresh starts afresh)."""
        try:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = self._open()
            self.transactions += 1
            with bounded(conn, self.timeout_s):
                return build_snapshot(conn, self.tables, self._history)
        except BaseException:
            self._close()
            raise

    def _open(self) -> psycopg.Connection[Any]:
        timeout = max(2, math.ceil(self.timeout_s))
        conn = psycopg.connect(
            self._dsn,
            autocommit=True,
            connect_timeout=timeout,
            application_name=APPLICATION_NAME,
            # A silent network ends a statement's wait within about this bound too.
            keepalives=1,
            keepalives_idle=timeout,
            keepalives_interval=1,
            keepalives_count=3,
            tcp_user_timeout=timeout * 1000,
        )
        self.connections += 1
        conn.read_only = True  # every transaction: BEGIN READ ONLY
        conn.cursor_factory = self._counted.cursor_class()
        return conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # ------------------------------------------------------------------ listening

    async def _listen(self) -> None:
        """``LISTEN`` on the leader channel; each notification pokes the loop. The
        session is opened again after a failure (every ``5 * period_s``)."""
        while True:
            try:
                conn = await asyncio.wait_for(
                    psycopg.AsyncConnection.connect(
                        self._dsn,
                        autocommit=True,
                        connect_timeout=max(2, math.ceil(self.timeout_s)),
                        application_name=APPLICATION_NAME,
                    ),
                    self.timeout_s + 1,
                )
                self._listen_conn = conn
                self.connections += 1
                async with asyncio.timeout(self.timeout_s):
                    self._listen_statements += 1
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(LEADER_CHANNEL)))
                self.listening = True
                self._poked.set()  # what changed while nobody listened
                async with contextlib.aclosing(conn.notifies()) as notifies:
                    async for _ in notifies:
                        self._poked.set()
            except Exception as exc:
                log.warning("dashboard_listen_failed", error=safe_error(exc), lock=APPLICATION_NAME)
            finally:
                self.listening = False
                await self._close_listening()
            await asyncio.sleep(5 * self.period_s)

    async def _close_listening(self) -> None:
        conn, self._listen_conn = self._listen_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(conn.close()), self.timeout_s)
