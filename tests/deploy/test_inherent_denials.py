"""What another role can always do to a fleet, whatever the library does: deny it
(documented on the Security page). Each test shows the denial and that it ends with the
other role's sessions. A cluster of this module's own, with few connections."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pgleaderlock
from pgleaderlock import LeaderLock, Semaphore, slot_keys
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.poll import eventually
from support.server import prepared_cluster
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]

FAST: dict[str, Any] = timings(
    retry_s=0.2, health_interval_s=0.2, connect_timeout_s=1.0, load_plugins=False
)
MAX_CONNECTIONS = 12  # 9 for roles that are not superusers (3 are reserved)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayPostgres]:
    with prepared_cluster(
        "CREATE ROLE app LOGIN", "CREATE ROLE other LOGIN", max_connections=MAX_CONNECTIONS
    ) as pg:
        yield pg


def dsn(pg: ThrowawayPostgres, role: str) -> str:
    return make_conninfo(pg.dsn, user=role)


@contextlib.asynccontextmanager
async def every_connection(pg: ThrowawayPostgres) -> AsyncIterator[int]:
    """``other`` opens sessions until the server refuses one; yields how many it got,
    and closes them on the way out."""
    held: list[psycopg.AsyncConnection[Any]] = []
    try:
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(dsn(pg, "other"), connect_timeout=2)
            except psycopg.OperationalError:
                break
            held.append(conn)
        yield len(held)
    finally:
        for conn in held:
            await conn.close()


async def test_a_role_holding_every_slot_denies_a_semaphore(cluster: ThrowawayPostgres) -> None:
    """``other`` takes both slots of a 2-slot semaphore (their keys are public): no
    holder of ``app`` gets in while it holds them; the first slot it lets go is taken."""
    name = "transcoders"
    async with await psycopg.AsyncConnection.connect(
        dsn(cluster, "other"), autocommit=True
    ) as conn:
        for keys in slot_keys(name, 2):
            await conn.execute("SELECT pg_advisory_lock(%s, %s)", keys)
        async with Semaphore(
            dsn(cluster, "app"), name, **lock_args(FAST, slots=2, rescan_s=0.2)
        ) as sem:
            assert not await sem.wait_for_leadership(1.5)
            await conn.execute("SELECT pg_advisory_unlock(%s, %s)", slot_keys(name, 2)[1])
            assert await sem.wait_for_leadership(10)
            assert sem.slot == 1


async def test_using_every_connection_stops_new_sessions_not_the_leader(
    cluster: ThrowawayPostgres,
) -> None:
    """``other`` opens every connection the server allows a role that is not a
    superuser: the leader keeps its session and leads on; ``current_leader()`` and a new
    candidate cannot connect (``current_leader`` raises ``ConnectionError``, the
    candidate retries) until ``other``'s sessions end."""
    keys = (4242, 2424)
    leader = LeaderLock(dsn(cluster, "app"), *keys, **lock_args(FAST))
    candidate = LeaderLock(dsn(cluster, "app"), *keys, **lock_args(FAST))
    async with leader:
        assert await leader.wait_for_leadership(10)
        async with every_connection(cluster) as opened:
            assert 0 < opened < MAX_CONNECTIONS
            await candidate.start()
            await asyncio.sleep(1.5)  # several probes of the leader, attempts of the candidate
            assert leader.is_leader
            assert candidate.statistics().last_error is not None
            with pytest.raises(pgleaderlock.ConnectionError, match="connection slots"):
                await pgleaderlock.current_leader(dsn(cluster, "app"), keys, timeout_s=2)
        found = await pgleaderlock.current_leader(dsn(cluster, "app"), keys, timeout_s=5)
        assert found is not None
        assert found.pid == leader.backend_pid
        await eventually(lambda: candidate.backend_pid is not None, what="the candidate connects")
        await candidate.shutdown()
