"""Fencing on a real server: the term table (its row, terms that only increase, across
leaders and server restarts, the acquire delay, the schema), the threaded lock's fence,
and what ``fence()`` refuses.

Each test uses its own lock name and its own fencing table (dropped afterwards), so the
tests share the server with everything else.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from pgleaderlock import (
    ConfigurationError,
    FencedError,
    FixedInterval,
    LeaderLock,
    LockState,
    ThreadedLeaderLock,
    lock_keys,
)
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.fencing_kinds import PsycopgBlock, leads, queued, unique
from support.fixture_types import MakeLock
from support.poll import eventually
from support.server import Admin, dsn_to_url
from support.timings import FENCED_TIMINGS, lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_term_row_has_holder_and_acquired_at(
    fenced_lock: MakeLock, fencing_table: str, admin: Admin
) -> None:
    """One row per lock, keyed by its keys, naming the holder (its application_name)
    and when it acquired the lock."""
    cur = await admin.execute("SELECT now()")
    before = (await cur.fetchone() or [None])[0]
    lock = fenced_lock(application_name="fencing-row-test")
    term = await leads(lock)
    cur = await admin.execute(
        f"SELECT key1, key2, term, holder, acquired_at, now() FROM {fencing_table}".encode()
    )
    table_rows = await cur.fetchall()
    assert len(table_rows) == 1
    key1, key2, row_term, holder, acquired_at, now = table_rows[0]
    assert (key1, key2) == lock.keys
    assert row_term == term
    assert holder == "fencing-row-test" == lock.application_name
    assert before <= acquired_at <= now
    assert term >> 32 >= 1  # the server's timeline in the high bits


async def test_term_is_none_unless_leader(fenced_lock: MakeLock, admin: Admin) -> None:
    first = fenced_lock(retry_strategy=FixedInterval(10.0))
    second = fenced_lock(retry_strategy=FixedInterval(1.0))
    assert first.term is None
    assert first.statistics().term is None
    with pytest.raises(FencedError, match="not leader"):
        await first.fence(object())
    term = await leads(first)
    assert first.statistics().term == term
    await second.start()
    await queued(admin, second)
    assert second.state is not LockState.LEADER
    assert second.term is None
    assert second.statistics().term is None
    await first.step_down()
    assert first.term is None
    assert await second.wait_for_leadership(10)
    assert second.term == term + 1
    await second.shutdown(timeout_s=10)
    assert second.term is None
    assert second.statistics().term is None


async def test_terms_strictly_increase_across_leaders(
    fenced_lock: MakeLock,
) -> None:
    """Three competing locks; whoever leads steps down, nine times: every leadership
    has the next term."""
    locks = [fenced_lock(retry_strategy=FixedInterval(0.05)) for _ in range(3)]
    for lock in locks:
        await lock.start()
    terms: list[int] = []
    for _ in range(9):

        async def one_leads() -> bool:
            return sum(lock.is_leader for lock in locks) == 1

        await eventually(one_leads, 10.0, "one of the three locks leads")
        leader = next(lock for lock in locks if lock.is_leader)
        assert leader.term is not None
        terms.append(leader.term)
        await leader.step_down()
    assert terms == list(range(terms[0], terms[0] + 9)), terms


async def test_terms_increase_across_server_restarts(
    fenced_lock: MakeLock, throwaway_pg: ThrowawayPostgres
) -> None:
    """The term is durable: after a fast and an immediate (crash-like) restart the lock
    leads again with a higher term, and a new lock continues from there."""
    lock = fenced_lock(dsn=throwaway_pg.dsn, retry_strategy=FixedInterval(0.1))
    terms = [await leads(lock)]
    for mode in ("fast", "immediate"):
        await asyncio.to_thread(throwaway_pg.restart, mode)

        async def leads_again(previous: int = terms[-1]) -> bool:
            return lock.term is not None and lock.term != previous

        await eventually(leads_again, 30.0, f"the lock leads again after a {mode} restart")
        assert lock.term is not None
        terms.append(lock.term)
    await lock.shutdown(timeout_s=10)
    terms.append(await leads(fenced_lock(dsn=throwaway_pg.dsn)))
    assert terms == sorted(set(terms)), terms


async def test_acquire_delay_holds_leader_back_after_the_bump(
    fenced_lock: MakeLock, fencing_table: str, admin: Admin
) -> None:
    """With ``acquire_delay_s`` the term is bumped first, then the lock stays ACQUIRING
    (no term, fence() refused) for the delay, then leads with that term."""
    lock = fenced_lock(acquire_delay_s=2.0)
    await lock.start()

    async def bumped() -> bool:
        cur = await admin.execute("SELECT to_regclass(%s) IS NOT NULL", (fencing_table,))
        if await cur.fetchone() != (True,):
            return False
        cur = await admin.execute(f"SELECT term FROM {fencing_table}".encode())
        return bool(await cur.fetchall())

    await eventually(bumped, 10.0, "the term bump")
    assert lock.state is LockState.ACQUIRING
    assert lock.term is None
    with pytest.raises(FencedError, match="not leader"):
        await lock.fence(object())
    assert await lock.wait_for_leadership(10)
    cur = await admin.execute(f"SELECT term FROM {fencing_table}".encode())
    assert await cur.fetchall() == [(lock.term,)]


async def test_fencing_schema(pg_dsn: str, admin: Admin) -> None:
    """``fencing_schema``: the table is created in that schema and fence() reads it."""
    schema, table = unique("test_fencing_schema"), unique("Test_Terms")
    await admin.execute(f"CREATE SCHEMA {schema}".encode())
    lock = LeaderLock.from_name(
        unique("test-fencing"),
        pg_dsn,
        **lock_args(
            {**FENCED_TIMINGS, "fencing": True, "fencing_table": table, "fencing_schema": schema}
        ),
    )
    try:
        term = await leads(lock)
        cur = await admin.execute(f'SELECT term FROM {schema}."{table}"'.encode())
        assert await cur.fetchall() == [(term,)]
        async with PsycopgBlock(pg_dsn).transaction() as conn:
            assert await lock.fence(conn) == term
    finally:
        await lock.shutdown(timeout_s=10)
        await admin.execute(f"DROP SCHEMA {schema} CASCADE".encode())


def test_threaded_lock_fences_a_sync_connection(pg_dsn: str) -> None:
    """The threaded lock's way, with no event loop in the caller's thread:
    ``threaded.lock.fence_sync(conn)`` inside ``with conn.transaction():``."""
    table = unique("test_terms")
    options = {**FENCED_TIMINGS, "fencing": True, "fencing_table": table}
    options["retry_strategy"] = FixedInterval(10.0)  # stays a follower after step_down
    inner = LeaderLock.from_name(unique("test-fencing-threaded"), pg_dsn, **lock_args(options))
    try:
        with ThreadedLeaderLock(inner) as threaded, psycopg.connect(pg_dsn) as conn:
            assert threaded.wait_for_leadership(10)
            term = threaded.lock.term
            assert term is not None
            with conn.transaction():
                assert threaded.lock.fence_sync(conn) == term
            threaded.step_down()
            with pytest.raises(FencedError), conn.transaction():
                threaded.lock.fence_sync(conn)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {table}".encode())


async def test_fence_needs_fencing_and_a_known_connection(
    pg_dsn: str, fenced_lock: MakeLock
) -> None:
    plain = LeaderLock.from_name(unique("test-fencing-off"), pg_dsn, **lock_args(FENCED_TIMINGS))
    with pytest.raises(ConfigurationError, match="fencing=True"):
        await plain.fence(object())
    with pytest.raises(ConfigurationError, match="fencing=True"):
        plain.fence_sync(object())
    lock = fenced_lock()
    await leads(lock)
    with pytest.raises(ConfigurationError, match=r"builtins\.object"):
        await lock.fence(object())
    async with await psycopg.AsyncConnection.connect(pg_dsn, connect_timeout=5) as aconn:
        with pytest.raises(ConfigurationError, match="AsyncConnection"):
            lock.fence_sync(aconn)
    with (
        psycopg.connect(pg_dsn, connect_timeout=5) as conn,
        pytest.raises(ConfigurationError, match=r"psycopg\.Connection"),
    ):
        await lock.fence(conn)


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_fence_refuses_a_sqlalchemy_autocommit_engine(
    driver: str, pg_dsn: str, fenced_lock: MakeLock
) -> None:
    """``create_async_engine(..., isolation_level="AUTOCOMMIT")``: the connections and
    sessions of that engine run every statement in its own transaction, so the fence's
    row lock would end with the fence itself: refused."""
    engine = create_async_engine(
        dsn_to_url(pg_dsn, f"postgresql+{driver}"), isolation_level="AUTOCOMMIT"
    )
    try:
        lock = fenced_lock()
        await leads(lock)
        async with engine.connect() as conn:
            with pytest.raises(ConfigurationError, match="inside the transaction"):
                await lock.fence(conn)
        async with AsyncSession(engine) as session:
            with pytest.raises(ConfigurationError, match="inside the transaction"):
                await lock.fence(session)
    finally:
        await engine.dispose()


async def test_candidate_process_with_fencing(
    pg_dsn: str, fencing_table: str, admin: Admin
) -> None:
    """``CandidateOptions(fencing=True, ...)``: the child's lock bumps the term, and its
    ``acquired`` event carries it; without the options the command line is unchanged."""
    assert not any("fenc" in arg or "delay" in arg for arg in CandidateOptions().argv())
    options = CandidateOptions(fencing=True, fencing_table=fencing_table, acquire_delay_s=0.01)
    keys = lock_keys(unique("test-fencing-candidate"))
    async with CandidateProcess("fenced", pg_dsn, *keys, options=options) as child:
        acquired = await child.wait_event("acquired", timeout_s=10)
        cur = await admin.execute(
            f"SELECT term FROM {fencing_table} WHERE key1 = %s AND key2 = %s".encode(), keys
        )
        assert await cur.fetchone() == (acquired.data["term"],)
