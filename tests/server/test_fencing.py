"""Fencing on a real server: ``lock.fence(conn)`` on every kind of connection it takes,
the term table, and the next leader waiting for the old term's open fenced transactions.

Each test uses its own lock name and its own fencing table (dropped afterwards), so the
tests share the server with everything else. The randomized fault run (processes,
SIGSTOP, server restarts) is tests/faults/test_fencing.py.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

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
from support.fixture_types import MakeLock
from support.poll import eventually
from support.server import Admin, dsn_to_url, lock_holders
from support.timings import FENCED_TIMINGS, lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


# ---------------------------------------------------------------- the connection kinds


class Kind(abc.ABC):
    """A kind of connection that ``fence()`` takes: a transaction on it (committed when
    the block ends without an exception), the same kind with no transaction open, and
    how to run a statement on it."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    @abc.abstractmethod
    def transaction(self) -> contextlib.AbstractAsyncContextManager[Any]: ...

    @abc.abstractmethod
    def outside(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A connection of this kind on which ``fence()`` would run outside any
        transaction (autocommit)."""

    @abc.abstractmethod
    async def execute(self, conn: Any, sql: str) -> None: ...

    async def fence(self, lock: LeaderLock, conn: Any) -> int:
        return await lock.fence(conn)

    async def aclose(self) -> None:
        return None


class PsycopgBlock(Kind):
    """psycopg ``AsyncConnection`` in autocommit mode, inside ``conn.transaction()``."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with (
            await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, connect_timeout=5
            ) as conn,
            conn.transaction(),
        ):
            yield conn

    @contextlib.asynccontextmanager
    async def outside(self) -> AsyncIterator[Any]:
        async with await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, connect_timeout=5
        ) as conn:
            yield conn

    async def execute(self, conn: Any, sql: str) -> None:
        await conn.execute(sql.encode())


class PsycopgImplicit(PsycopgBlock):
    """psycopg ``AsyncConnection`` not in autocommit mode: the first statement (the
    fence) begins the transaction, leaving the ``async with`` block commits it."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=5) as conn:
            yield conn


class Asyncpg(Kind):
    """asyncpg ``Connection`` inside ``conn.transaction()``."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.url = dsn_to_url(dsn)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        conn = await asyncpg.connect(self.url, timeout=5)
        try:
            yield conn
        finally:
            await conn.close(timeout=5)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.connection() as conn, conn.transaction():
            yield conn

    def outside(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.connection()

    async def execute(self, conn: Any, sql: str) -> None:
        await conn.execute(sql, timeout=5)


class AsyncpgPool(Asyncpg):
    """A connection of an asyncpg pool (a ``PoolConnectionProxy``), inside
    ``conn.transaction()``."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._pool: Any = None

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        if self._pool is None:
            self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=2, timeout=5)
        async with self._pool.acquire(timeout=5) as conn:
            yield conn

    async def aclose(self) -> None:
        if self._pool is not None:
            await asyncio.wait_for(self._pool.close(), 10)


class SAConnection(Kind):
    """SQLAlchemy ``AsyncConnection`` inside ``conn.begin()``."""

    def __init__(self, dsn: str, driver: str) -> None:
        super().__init__(dsn)
        url = dsn_to_url(dsn, f"postgresql+{driver}")
        self.engine: AsyncEngine = create_async_engine(
            url, pool_size=2, max_overflow=0, pool_timeout=5
        )

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.engine.connect() as conn, conn.begin():
            yield conn

    @contextlib.asynccontextmanager
    async def outside(self) -> AsyncIterator[Any]:
        async with self.engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")

    async def execute(self, conn: Any, sql: str) -> None:
        await conn.execute(text(sql))

    async def aclose(self) -> None:
        await self.engine.dispose()


class SASession(SAConnection):
    """SQLAlchemy ``AsyncSession`` inside ``session.begin()``; outside a transaction:
    a session bound to the engine with ``isolation_level="AUTOCOMMIT"``."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with AsyncSession(self.engine) as session, session.begin():
            yield session

    @contextlib.asynccontextmanager
    async def outside(self) -> AsyncIterator[Any]:
        autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        async with AsyncSession(autocommit) as session:
            yield session


class SyncPsycopg(Kind):
    """A synchronous psycopg ``Connection`` with ``lock.fence_sync(conn)`` (the threaded
    lock's way), not in autocommit mode: the fence begins the transaction. Every call
    runs in a worker thread, as it would next to a running event loop."""

    @contextlib.asynccontextmanager
    async def connection(self, *, autocommit: bool) -> AsyncIterator[Any]:
        def connect() -> psycopg.Connection[tuple[Any, ...]]:
            return psycopg.connect(self.dsn, autocommit=autocommit, connect_timeout=5)

        conn = await asyncio.to_thread(connect)
        try:
            yield conn
        finally:
            await asyncio.to_thread(conn.close)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.connection(autocommit=False) as conn:
            yield conn
            await asyncio.to_thread(conn.commit)

    def outside(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.connection(autocommit=True)

    async def execute(self, conn: Any, sql: str) -> None:
        await asyncio.to_thread(conn.execute, sql.encode())

    async def fence(self, lock: LeaderLock, conn: Any) -> int:
        return await asyncio.to_thread(lock.fence_sync, conn)


class SyncPsycopgBlock(SyncPsycopg):
    """A synchronous psycopg ``Connection`` in autocommit mode inside
    ``with conn.transaction():`` (entered and left in a worker thread)."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.connection(autocommit=True) as conn:
            block = conn.transaction()
            await asyncio.to_thread(block.__enter__)
            try:
                yield conn
            except BaseException as exc:
                await asyncio.to_thread(block.__exit__, type(exc), exc, exc.__traceback__)
                raise
            await asyncio.to_thread(block.__exit__, None, None, None)


KINDS: dict[str, Callable[[str], Kind]] = {
    "psycopg": PsycopgBlock,
    "psycopg-implicit": PsycopgImplicit,
    "asyncpg": Asyncpg,
    "asyncpg-pool": AsyncpgPool,
    "sqlalchemy-conn-asyncpg": lambda dsn: SAConnection(dsn, "asyncpg"),
    "sqlalchemy-conn-psycopg": lambda dsn: SAConnection(dsn, "psycopg"),
    "sqlalchemy-session-asyncpg": lambda dsn: SASession(dsn, "asyncpg"),
    "sqlalchemy-session-psycopg": lambda dsn: SASession(dsn, "psycopg"),
    "sync-psycopg": SyncPsycopg,
    "sync-psycopg-block": SyncPsycopgBlock,
}


@pytest.fixture(params=list(KINDS))
async def kind(request: pytest.FixtureRequest, pg_dsn: str) -> AsyncIterator[Kind]:
    made = KINDS[request.param](pg_dsn)
    try:
        yield made
    finally:
        await made.aclose()


# ---------------------------------------------------------------- locks and tables


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


async def rows(admin: Admin, table: str) -> list[tuple[Any, ...]]:
    cur = await admin.execute(f"SELECT * FROM {table} ORDER BY 1".encode())
    return await cur.fetchall()


async def leads(lock: LeaderLock) -> int:
    """Start ``lock``, wait until it leads; its term."""
    await lock.start()
    assert await lock.wait_for_leadership(10)
    assert lock.term is not None
    return lock.term


async def queued(admin: Admin, lock: LeaderLock) -> None:
    """Wait until ``lock``'s session waits on the server for the advisory lock."""

    async def waiting() -> bool:
        pid = lock.backend_pid
        return pid is not None and pid in await lock_holders(admin, *lock.keys, granted=False)

    await eventually(waiting, 10.0, f"{lock.label} queued for the lock")


# ---------------------------------------------------------------- every connection kind


async def test_fence_returns_the_current_term(
    kind: Kind, fenced_lock: MakeLock, work_table: str, admin: Admin
) -> None:
    """Inside a transaction, fence() returns the lock's current term, and the
    transaction's writes commit as usual (also through ``lock.fenced(conn)``)."""
    lock = fenced_lock()
    term = await leads(lock)
    async with kind.transaction() as conn:
        assert await kind.fence(lock, conn) == term
        await kind.execute(conn, f"INSERT INTO {work_table} (term) VALUES ({term})")
    if not isinstance(kind, SyncPsycopg):
        async with kind.transaction() as conn, lock.fenced(conn) as fenced_term:
            assert fenced_term == term
            await kind.execute(conn, f"INSERT INTO {work_table} (term) VALUES ({term})")
    assert lock.term == term
    assert lock.statistics().term == term
    expected = 1 if isinstance(kind, SyncPsycopg) else 2
    assert await rows(admin, work_table) == [(term,)] * expected


async def test_fence_raises_once_another_lock_took_over(
    kind: Kind, fenced_lock: MakeLock, work_table: str, admin: Admin
) -> None:
    """The first lock steps down, the second leads with term + 1: the first's fence()
    raises FencedError (its transaction rolls back), the second's passes."""
    first = fenced_lock(retry_strategy=FixedInterval(10.0))
    second = fenced_lock(retry_strategy=FixedInterval(1.0))
    term = await leads(first)
    await second.start()
    await queued(admin, second)
    await first.step_down()
    assert await second.wait_for_leadership(10)
    assert second.term == term + 1
    assert first.term is None
    with pytest.raises(FencedError, match="not leader"):
        async with kind.transaction() as conn:
            await kind.fence(first, conn)
            await kind.execute(conn, f"INSERT INTO {work_table} (term) VALUES ({term})")
    async with kind.transaction() as conn:
        assert await kind.fence(second, conn) == term + 1
        await kind.execute(conn, f"INSERT INTO {work_table} (term) VALUES ({term + 1})")
    assert await rows(admin, work_table) == [(term + 1,)]


async def test_fence_raises_when_the_term_moved_on(
    kind: Kind,
    fenced_lock: MakeLock,
    fencing_table: str,
    work_table: str,
    admin: Admin,
) -> None:
    """A lock that still believes it leads, but whose term was bumped by another (here:
    by hand, as a new leader's bump would), is fenced off: FencedError, nothing commits."""
    lock = fenced_lock()
    term = await leads(lock)
    await admin.execute(
        f"UPDATE {fencing_table} SET term = term + 1 WHERE key1 = %s AND key2 = %s".encode(),
        lock.keys,
    )
    assert lock.is_leader
    assert lock.term == term
    with pytest.raises(FencedError, match=f"moved on from {term} to {term + 1}"):
        async with kind.transaction() as conn:
            await kind.fence(lock, conn)
            await kind.execute(conn, f"INSERT INTO {work_table} (term) VALUES ({term})")
    assert await rows(admin, work_table) == []


async def test_fence_outside_a_transaction_is_refused(kind: Kind, fenced_lock: MakeLock) -> None:
    """In autocommit mode the row lock would end with the statement: fence() refuses."""
    lock = fenced_lock()
    await leads(lock)
    async with kind.outside() as conn:
        with pytest.raises(ConfigurationError, match="inside the transaction"):
            await kind.fence(lock, conn)


async def test_next_leader_waits_for_an_open_fenced_transaction(
    kind: Kind, fenced_lock: MakeLock, work_table: str, admin: Admin
) -> None:
    """A transaction that passed fence() and is still open holds the next leader back:
    it is granted the advisory lock, but its term bump waits for the row, so it stays
    ACQUIRING (is_leader False) until the transaction ends; the old term's write
    commits, then the new leader leads with term + 1."""
    first = fenced_lock(retry_strategy=FixedInterval(10.0))
    second = fenced_lock(retry_strategy=FixedInterval(1.0))
    term = await leads(first)
    await second.start()
    await queued(admin, second)
    async with kind.transaction() as conn:
        assert await kind.fence(first, conn) == term
        await first.step_down()

        async def bump_waits() -> bool:
            pid = second.backend_pid
            if pid is None or await lock_holders(admin, *second.keys) != [pid]:
                return False
            cur = await admin.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            return await cur.fetchone() == ("Lock",)

        await eventually(bump_waits, 10.0, "the second lock's term bump waits for the row")
        for _ in range(5):  # and it keeps waiting while the transaction is open
            assert second.state is LockState.ACQUIRING
            assert not second.is_leader
            assert second.term is None
            await asyncio.sleep(0.05)
        await kind.execute(conn, f"INSERT INTO {work_table} (term) VALUES ({term})")
    assert await second.wait_for_leadership(5)
    assert second.term == term + 1
    assert await rows(admin, work_table) == [(term,)]


async def test_an_old_terms_fenced_transaction_is_ended_after_the_grace(
    pg_dsn: str,
    fenced_lock: MakeLock,
    work_table: str,
    admin: Admin,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fenced transaction of the old term that stays open (its leader frozen, or cut
    off from the server) does not keep the next leader out: its term bump waits
    ``fencing_grace_s``, then ends that transaction's session (fencing rolls it back
    anyway) and leads with term + 1. The old transaction never commits."""
    first = fenced_lock(retry_strategy=FixedInterval(10.0))
    second = fenced_lock(retry_strategy=FixedInterval(0.2), fencing_grace_s=0.5)
    errors: list[Exception] = []
    second.on_error(errors.append)
    term = await leads(first)
    await second.start()
    await queued(admin, second)
    with pytest.raises(psycopg.OperationalError, match="administrator command"):
        async with PsycopgBlock(pg_dsn).transaction() as conn:
            assert await first.fence(conn) == term
            old = conn.info.backend_pid
            await first.step_down()
            assert await second.wait_for_leadership(10)
            await conn.execute(f"INSERT INTO {work_table} (term) VALUES ({term})".encode())
    assert second.term == term + 1
    assert errors == []
    assert await rows(admin, work_table) == []
    events = [(r.getMessage().split()[0], r.getMessage()) for r in caplog.records]
    assert [e for e, _ in events if e.startswith(("term_bump", "fenced_"))] == [
        "term_bump_blocked",
        "fenced_sessions_ended",
    ], events
    assert f'pids="[{old}]"' in dict(events)["fenced_sessions_ended"]


async def test_fence_does_not_wait_for_a_term_bump(
    kind: Kind, fenced_lock: MakeLock, fencing_table: str, admin: Admin
) -> None:
    """While a term bump holds the term row (a new leadership is beginning), fence()
    fails at once with FencedError instead of waiting for the bump (``SKIP LOCKED``)."""
    lock = fenced_lock()
    term = await leads(lock)
    async with await psycopg.AsyncConnection.connect(admin.info.dsn, connect_timeout=5) as bumper:
        await bumper.execute(  # begins a transaction, as a bump's statement does
            f"UPDATE {fencing_table} SET term = term + 1 WHERE key1 = %s AND key2 = %s".encode(),
            lock.keys,
        )
        with pytest.raises(FencedError, match=f"term {term} could not be confirmed"):
            async with asyncio.timeout(5), kind.transaction() as conn:
                await kind.fence(lock, conn)
        await bumper.rollback()


# ---------------------------------------------------------------- the term


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


# ---------------------------------------------------------------- refusals


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
