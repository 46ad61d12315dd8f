"""Fencing on a real server: ``lock.fence(conn)`` on every kind of connection it takes
(tests/support/fencing_kinds.py), and the next leader waiting for the old term's open
fenced transactions. The term table and the refusals: test_fencing_terms.py.

Each test uses its own lock name and its own fencing table (dropped afterwards), so the
tests share the server with everything else. The randomized fault run (processes,
SIGSTOP, server restarts) is tests/faults/test_fencing.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest

from pgleaderlock import ConfigurationError, FencedError, FixedInterval, LockState
from support.fencing_kinds import KINDS, Kind, PsycopgBlock, SyncPsycopg, leads, queued, rows
from support.fixture_types import MakeLock
from support.poll import eventually
from support.server import Admin, lock_holders

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(params=list(KINDS))
async def kind(request: pytest.FixtureRequest, pg_dsn: str) -> AsyncIterator[Kind]:
    made = KINDS[request.param](pg_dsn)
    try:
        yield made
    finally:
        await made.aclose()


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
