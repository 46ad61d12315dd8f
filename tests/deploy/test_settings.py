"""Settings a role carries do not reach the lock's own session (docs/guides/ha-and-poolers.md,
"Settings a role or database imposes").

A cluster of this module's own (never the shared server) has a role ``hostile`` with
``statement_timeout = 200ms``, ``idle_session_timeout = 1s`` and
``idle_in_transaction_session_timeout = 300ms``, and ``log_lock_waits = on``. Without the
library's own settings (``IMMUNE_SETTINGS``, applied with ``set_config`` when a session is
set up) every follower wait would be cancelled after 200 ms, failover would take up to a
retry delay instead of milliseconds, and an idle leader's session would be ended after
1 s (leadership flapping with every probe interval).

What the server logs for a follower, with ``log_lock_waits = on`` (measured here, for
the docs): the follower waits in one piece, with no ``lock_timeout`` (see
``BaseSession.wait_lock``), so its backend logs one ``LOG: process N still waiting for
ExclusiveLock on advisory lock`` (with ``DETAIL`` and ``STATEMENT`` lines) once
``deadlock_timeout`` (1 s) has passed, and ``LOG: process N acquired ExclusiveLock ...
after N ms`` when it is granted: no ERROR, however many retry delays the wait spans.
PostgreSQL logs a wait again at every wake-up of the waiting backend, which is why
``client_connection_check_interval`` is left off where the server logs lock waits.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from pgleaderlock import FixedInterval, LeaderLock, LockOptions, LockState
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.fixture_types import Figures, MakeRecorder
from support.poll import eventually
from support.server import admin_session, lock_holders, prepared_cluster

if TYPE_CHECKING:
    pass

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]

Admin = psycopg.AsyncConnection[Any]

ROLE = "hostile"
ROLE_SETTINGS = {
    "statement_timeout": "200ms",
    "idle_session_timeout": "1s",
    "idle_in_transaction_session_timeout": "300ms",
}
CLUSTER_SETTINGS = {
    "log_lock_waits": "on",  # deadlock_timeout stays 1 s
    "log_line_prefix": "%m [%p] ",  # every line names its backend
}
FAILOVER_BOUND_S = 1.0
"""Generous ("milliseconds"): a cancelled wait would leave the lock free for a retry delay."""

_LINE = re.compile(r"^\S+ \S+ \S+ \[(\d+)\] (\w+):\s+(.*)$")


@dataclass
class HostileCluster:
    """The module's cluster and the DSN of its role with hostile settings."""

    pg: ThrowawayPostgres

    def dsn(self, backend: str) -> str:
        base = self.pg.dsn.replace("postgres@", f"{ROLE}@", 1)
        return base.replace("postgresql://", f"postgresql+{backend}://", 1)

    def log_offset(self) -> int:
        return self.pg.log_path.stat().st_size

    def log_lines(self, offset: int) -> list[tuple[int, str, str]]:
        """``(pid, level, message)`` of every prefixed server log line since ``offset``."""
        with self.pg.log_path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        found = (_LINE.match(line) for line in text.splitlines())
        return [(int(m[1]), m[2], m[3]) for m in found if m is not None]


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileCluster]:
    role_settings = (
        f"ALTER ROLE {ROLE} SET {name} = '{value}'" for name, value in ROLE_SETTINGS.items()
    )
    create = f"CREATE ROLE {ROLE} LOGIN"
    with prepared_cluster(create, *role_settings, settings=CLUSTER_SETTINGS) as pg:
        yield HostileCluster(pg)


@pytest.fixture
async def hostile_admin(hostile: HostileCluster) -> AsyncIterator[Admin]:
    """An admin session on the hostile cluster."""
    async with admin_session(hostile.pg.dsn, connect_timeout=5) as conn:
        yield conn


def test_the_role_really_is_hostile(hostile: HostileCluster) -> None:
    """A plain session of the role gets the settings (so the tests below mean something)."""
    dsn = hostile.dsn("psycopg").replace("+psycopg", "")
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        for name, value in ROLE_SETTINGS.items():
            row = conn.execute(f"SHOW {name}").fetchone()
            assert row == (value,)
        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            conn.execute("SELECT pg_sleep(0.5)")
        time.sleep(1.5)
        with pytest.raises(psycopg.Error):
            conn.execute("SELECT 1")  # the server ended the idle session
        assert conn.closed
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        conn.execute("SELECT 1")  # a transaction is open now
        time.sleep(0.6)
        with pytest.raises(psycopg.Error):
            conn.execute("SELECT 1")
        assert conn.closed


async def test_failover_after_sigkill_stays_in_milliseconds(
    hostile: HostileCluster,
    hostile_admin: Admin,
    keys: tuple[int, int],
    backend: str,
    recorder: MakeRecorder,
    figures: Figures,
) -> None:
    """The leader is a child process (library defaults); two in-process followers with
    the library's defaults wait on the server; the child is SIGKILLed."""
    dsn = hostile.dsn(backend)
    offset = hostile.log_offset()
    child = CandidateProcess("leader", dsn, *keys, options=CandidateOptions.library_defaults())
    followers = [
        LeaderLock(dsn, *keys, name=f"f{i}", options=LockOptions(load_plugins=False))
        for i in range(2)
    ]
    recs = [recorder(lock) for lock in followers]
    try:
        await child.start()
        await child.wait_event("acquired", timeout_s=10)
        for lock in followers:
            await lock.start()
        # Each follower: a try (taken), a 1 s wait, then a 2 s wait under way. A 200 ms
        # statement_timeout would have cancelled every one of those waits.
        await asyncio.gather(*(r.wait_event("acquire_failed", 2, timeout=15) for r in recs))
        pids = {lock.backend_pid for lock in followers}
        async with asyncio.timeout(5):  # the next waits start right after the callbacks
            while set(await lock_holders(hostile_admin, *keys, granted=False)) != pids:
                await asyncio.sleep(0.01)
        killed_at = await child.kill()
        await eventually(lambda: any(lock.is_leader for lock in followers), 10, "a new leader")
        leader = next(lock for lock in followers if lock.is_leader)
        acquired_at = time.monotonic()
        figures(f"{backend}: failover after SIGKILL, role statement_timeout=200ms",
                acquired_at - killed_at, "ms")  # fmt: skip
        assert acquired_at - killed_at < FAILOVER_BOUND_S
        assert await lock_holders(hostile_admin, *keys) == [leader.backend_pid]
    finally:
        await child.kill()
        await asyncio.gather(*(lock.shutdown(timeout_s=15) for lock in followers))
    for rec in recs:
        assert rec.errors() == []
    server_errors = [m for _, level, m in hostile.log_lines(offset) if level in ("ERROR", "FATAL")]
    assert not [m for m in server_errors if "lock timeout" not in m and "user request" not in m]


async def test_an_idle_leader_does_not_flap(
    hostile: HostileCluster,
    hostile_admin: Admin,
    keys: tuple[int, int],
    backend: str,
    recorder: MakeRecorder,
) -> None:
    """Default ``health_interval_s`` (5 s): the session idles 5 s between probes, five
    times ``idle_session_timeout``; over 6 s the leadership stays put."""
    lock = LeaderLock(hostile.dsn(backend), *keys, options=LockOptions(load_plugins=False))
    rec = recorder(lock)
    offset = hostile.log_offset()
    async with lock:
        assert await lock.wait_for_leadership(timeout_s=10)
        pid = lock.backend_pid
        events = len(rec.events)
        since = await _server_now(hostile_admin)
        await asyncio.sleep(6.0)
        assert rec.events[events:] == []  # no state change, no on_lost, no error
        assert lock.state is LockState.LEADER
        assert lock.backend_pid == pid
        assert await lock_holders(hostile_admin, *keys) == [pid]
        # The session idled ~5 s (five times idle_session_timeout), then was probed.
        cur = await hostile_admin.execute(
            "SELECT state, query_start > %s FROM pg_stat_activity WHERE pid = %s", (since, pid)
        )
        assert await cur.fetchone() == ("idle", True)
    assert "lost" not in rec.names()
    messages = [m for p, _, m in hostile.log_lines(offset) if p == pid]
    assert not [m for m in messages if "timeout" in m], messages


async def _server_now(hostile_admin: Admin) -> object:
    row = await (await hostile_admin.execute("SELECT clock_timestamp()")).fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
async def follower_log(
    hostile: HostileCluster,
    hostile_admin: Admin,
    keys: tuple[int, int],
    backend: str,
    recorder: MakeRecorder,
) -> list[tuple[str, str]]:
    """A plain session holds the lock; one follower (``FixedInterval(3)``: 3 s waits)
    makes a try and spends two retry delays waiting, then is granted the lock 1.6 s
    into the third. The follower backend's log lines."""
    offset = hostile.log_offset()
    lock = LeaderLock(hostile.dsn(backend), *keys, retry_strategy=FixedInterval(3.0), options=LockOptions(load_plugins=False))  # fmt: skip
    rec = recorder(lock)
    await hostile_admin.execute("SELECT pg_advisory_lock(%s, %s)", keys)
    try:
        async with lock:
            await rec.wait_event("acquire_failed", 3, timeout=15)  # the try + two delays
            await asyncio.sleep(1.6)
            await hostile_admin.execute("SELECT pg_advisory_unlock(%s, %s)", keys)
            assert await lock.wait_for_leadership(timeout_s=5)
            pid = lock.backend_pid
    finally:
        await hostile_admin.execute("SELECT pg_advisory_unlock_all()")
    assert rec.errors() == []
    await asyncio.sleep(0.1)  # the server's last lines reach the file
    return [(level, m) for p, level, m in hostile.log_lines(offset) if p == pid]


async def test_what_the_server_logs_per_follower_wait(
    follower_log: list[tuple[str, str]], backend: str, figures: Figures
) -> None:
    """Issue 10: "a follower does not make the server log a line every 0.5 s"; issue 19:
    no ERROR line for a follower at all."""
    lines = follower_log
    still = [m for level, m in lines if level == "LOG" and "still waiting" in m]
    errors = [m for level, m in lines if level in ("ERROR", "FATAL")]
    acquired = [m for level, m in lines if level == "LOG" and "acquired ExclusiveLock" in m]
    for level, message in lines:
        print(f"{level}: {message[:120]}")
    figures(f"{backend}: 'still waiting' entries over 7.6 s of waiting", len(still), "entries")
    # No lock_timeout ended a wait, and no statement_timeout cancelled one.
    assert errors == []
    assert len(still) == 1  # one wait, in one piece, logged once past deadlock_timeout
    assert len(acquired) == 1
