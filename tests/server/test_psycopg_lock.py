"""psycopg-specific behaviour on a real server.

The behaviour every backend shares (mutual exclusion, loss, hand-off, flap damping, wait
and poll modes, stuck networks, bad input, ...) is in tests/contract/, which runs it
for psycopg, asyncpg and SQLAlchemy alike.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from pgleaderlock import (
    ConfigurationError,
    LeaderLock,
    LockState,
)
from pgleaderlock.backends import psycopg as psycopg_backend
from support.fixture_types import LockPids, MakeRecorder
from support.poll import eventually
from support.server import Admin, driver_connection
from support.timings import lock_args, timings

if TYPE_CHECKING:
    pass

S = LockState
pytestmark = pytest.mark.timeout(60)

FAST: dict[str, Any] = timings(retry_s=0.02, health_interval_s=0.1)


def make(pg_dsn: str, keys: tuple[int, int], **kwargs: object) -> LeaderLock:
    return LeaderLock(pg_dsn, *keys, **lock_args({**FAST, **kwargs}))


async def test_one_hold_after_long_leadership(
    pg_dsn: str,
    keys: tuple[int, int],
    admin: Admin,
    holders: LockPids,
) -> None:
    """Health probes never re-acquire: one unlock frees the lock after many probes."""
    lock = make(pg_dsn, keys, health_interval_s=0.01, auto_reacquire=False)
    async with lock:
        assert await lock.wait_for_leadership(10)
        pid = lock.backend_pid
        cur = await admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        assert await cur.fetchone() == (1,)
        await asyncio.sleep(1.0)  # about a hundred probes
        assert await holders(*keys) == [pid]
        await lock.step_down()  # exactly one pg_advisory_unlock
        assert await holders(*keys) == []
        cur = await admin.execute("SELECT pg_try_advisory_lock(%s, %s)", keys)
        assert await cur.fetchone() == (True,)
        await admin.execute("SELECT pg_advisory_unlock(%s, %s)", keys)


async def test_periodic_probes_run_no_statement(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    """An idle leader's periodic probe is a bare protocol Sync: the server runs no
    statement for it (the backend's last statement stays the pg_locks probe that
    confirmed the lock), and statistics() counts the probes."""
    lock = make(pg_dsn, keys, health_interval_s=0.02)
    async with lock:
        assert await lock.wait_for_leadership(10)
        await asyncio.sleep(0.3)  # the pg_locks probe, then Syncs
        before = lock.statistics().probes
        await eventually(lambda: lock.statistics().probes - before >= 5, 5, "5 more probes")
        assert lock.is_leader
        cur = await admin.execute(
            "SELECT query FROM pg_stat_activity WHERE pid = %s", (lock.backend_pid,)
        )
        row = await cur.fetchone()
        assert row is not None
        assert "pg_locks" in row[0]  # not replaced by any later statement


async def test_lock_passes_partition_settings(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    lock = make(pg_dsn, keys, health_interval_s=3.0, health_timeout_s=1.0)
    async with lock:
        assert await lock.wait_for_leadership(10)
        # The lock's own settings, as derived from its timings (bound 4 s -> 5 s).
        assert lock.connect_options.server_settings["tcp_user_timeout"] == "5000"


async def test_dsn_options_are_kept(pg_dsn: str) -> None:
    query = "options=-c%20statement_timeout%3D12345"
    async with driver_connection(psycopg_backend.connect, pg_dsn, query, "x") as conn:
        cur = await conn.execute("SHOW statement_timeout")
        assert await cur.fetchone() == ("12345ms",)


async def test_pooled_connection_is_refused(
    pg_dsn: str, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    class FakePooled(psycopg.AsyncConnection[Any]):
        pass

    conns: list[FakePooled] = []
    returned: list[FakePooled] = []

    class Pool:  # the part of psycopg_pool.AsyncConnectionPool the library uses
        async def putconn(self, conn: FakePooled) -> None:
            returned.append(conn)

    async def connect() -> FakePooled:
        conn = await FakePooled.connect(pg_dsn, autocommit=True)
        conn._pool = Pool()  # what psycopg_pool sets on its connections
        conns.append(conn)
        return conn

    lock = LeaderLock(None, *keys, **lock_args(FAST, connect_fn=connect))
    rec = recorder(lock)
    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert isinstance(rec.errors()[0], ConfigurationError)
    assert "pool" in str(rec.errors()[0])
    assert returned == conns  # handed back to its pool, not kept or closed
    for conn in conns:
        await conn.close()
