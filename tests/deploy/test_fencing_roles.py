"""Ending an old term's fenced transactions takes a privilege (a real second role).

A cluster of this module's own has a role ``locker`` (the locks' role, which owns the
schema of the terms table) and a role ``app`` (which runs the fenced transactions, with
the row privileges the Fencing page asks for). The old leader's fenced transaction, on
``app``'s connection, stays open (a frozen process would never end it):

- without a privilege over ``app``'s sessions the next leader cannot end it: it logs
  ``fenced_sessions_not_ended`` and keeps waiting, a grace at a time, without leading,
  until the transaction ends; the transaction's write commits, ordered before the new
  term;
- with ``pg_signal_backend`` it ends the transaction's session after the grace and leads;
  the write never commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

from pgleaderlock import Fencing, FixedInterval, LeaderLock, LockOptions, LockState, Timing
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.poll import eventually
from support.server import admin_session, prepared_cluster

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]

Admin = psycopg.AsyncConnection[Any]

GRACE_S = 0.3
FAST: dict[str, Any] = {
    "retry_strategy": FixedInterval(0.05),
    "health_interval_s": 0.5,
    "options": LockOptions(
        timing=Timing(health_timeout_s=0.5),
        fencing=Fencing(enabled=True, schema="fencing", grace_s=GRACE_S),
        load_plugins=False,
    ),
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayPostgres]:
    with prepared_cluster(
        "CREATE ROLE locker LOGIN",
        "CREATE ROLE app LOGIN",
        "CREATE SCHEMA fencing AUTHORIZATION locker",
        "GRANT USAGE ON SCHEMA fencing TO app",
        "CREATE TABLE work (term int8 NOT NULL)",
        "GRANT INSERT, SELECT ON work TO app",
    ) as pg:
        yield pg


def role_dsn(pg: ThrowawayPostgres, role: str) -> str:
    return pg.dsn.replace("postgres@", f"{role}@", 1)


@pytest.fixture
async def cluster_admin(cluster: ThrowawayPostgres) -> AsyncIterator[Admin]:
    """An admin session on ``cluster``, its work table emptied and ``locker`` unable to
    signal other backends."""
    async with admin_session(cluster.dsn) as conn:
        await conn.execute("TRUNCATE work")
        await conn.execute("REVOKE pg_signal_backend FROM locker")
        yield conn


async def hand_over_with_a_fenced_transaction_open(
    pg: ThrowawayPostgres, cluster_admin: Admin, name: str, caplog: pytest.LogCaptureFixture
) -> tuple[LeaderLock, int, psycopg.AsyncConnection[Any]]:
    """The first lock leads and fences a transaction on ``app``'s connection, which stays
    open; then it shuts down, and the second lock is granted the advisory lock; its term
    bump waits. Returns the second lock, the first term and ``app``'s connection."""
    dsn = role_dsn(pg, "locker")
    first = LeaderLock.from_name(name, dsn, **FAST)
    second = LeaderLock.from_name(name, dsn, **FAST)
    await first.start()
    assert await first.wait_for_leadership(10)
    term = first.term
    assert term is not None
    await cluster_admin.execute(
        "GRANT SELECT, UPDATE (acquired_at) ON fencing.pgleaderlock_terms TO app"
    )  # the row privileges fence() needs
    conn = await psycopg.AsyncConnection.connect(role_dsn(pg, "app"))
    await first.fence(conn)  # begins app's transaction, and holds the term row
    await conn.execute("INSERT INTO work (term) VALUES (%s)", (term,))
    await second.start()
    await first.shutdown()
    await eventually(lambda: "term_bump_blocked" in caplog.text, 10, "the bump waits")
    return second, term, conn


async def test_without_the_privilege_the_new_term_waits_for_the_old_transaction(
    cluster: ThrowawayPostgres, cluster_admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    second, term, conn = await hand_over_with_a_fenced_transaction_open(
        cluster, cluster_admin, "roles-refused", caplog
    )
    try:
        await eventually(
            lambda: "fenced_sessions_not_ended" in caplog.text, 10, "the refusal is logged"
        )
        await asyncio.sleep(3 * GRACE_S)  # several graces: still waiting, not leading
        assert second.state is LockState.ACQUIRING
        assert not second.is_leader
        refusal = next(r for r in caplog.records if "fenced_sessions_not_ended" in r.getMessage())
        assert refusal.levelname == "ERROR"
        assert f"{conn.info.backend_pid} (app)" in refusal.getMessage()
        await conn.commit()  # the old transaction ends: the new term follows it
        assert await second.wait_for_leadership(10)
        assert second.term == term + 1
        cur = await cluster_admin.execute("SELECT term FROM work")
        assert await cur.fetchall() == [(term,)]  # ordered before the new term
    finally:
        await conn.close()
        await second.shutdown()


async def test_with_pg_signal_backend_the_old_transaction_is_ended(
    cluster: ThrowawayPostgres, cluster_admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    await cluster_admin.execute("GRANT pg_signal_backend TO locker")
    second, term, conn = await hand_over_with_a_fenced_transaction_open(
        cluster, cluster_admin, "roles-granted", caplog
    )
    try:
        assert await second.wait_for_leadership(10)
        assert second.term == term + 1
        assert "fenced_sessions_ended" in caplog.text
        assert "fenced_sessions_not_ended" not in caplog.text
        with pytest.raises(psycopg.OperationalError):
            await conn.commit()  # its session was ended: nothing of it commits
        cur = await cluster_admin.execute("SELECT term FROM work")
        assert await cur.fetchall() == []
    finally:
        await conn.close()
        await second.shutdown()
