"""A fence follows the leadership, not the process: work begun under term *t* fences
with *t*, and is refused once that leadership has ended, even after the lock has lost its
session and leads again (a zombie unit: finished inside ``asyncio.shield``, in a thread,
or after swallowing its cancellation). On a real server, with the lock's session ended
by ``pg_terminate_backend``; the FastAPI and APScheduler entry points are in
``tests/frameworks/test_fencing_leadership_pg.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from typing import Any

import psycopg
import pytest

from pgleaderlock import (
    FencedError,
    Fencing,
    FixedInterval,
    LeaderLock,
    Leadership,
    LeaderTasks,
    LockOptions,
    ThreadedLeaderLock,
)
from pgleaderlock.schedule import Run, Scheduler
from support.fixture_types import MakeLock
from support.leadership import TIMINGS, fenced_insert, lead_again, terms_in
from support.poll import eventually, eventually_sync
from support.server import Admin
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


class Unit:
    """A unit of work that outlives the leadership it began under: it waits for ``go``
    (set once the lock leads again), then runs a fenced transaction; its outcome is the
    term it committed under, or the error it got."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.go = threading.Event()
        self.done = threading.Event()
        self.outcome: int | BaseException | None = None

    async def finish(self, fence: Any, dsn: str, table: str) -> None:
        self.waiting.set()
        while not self.go.is_set():
            await asyncio.sleep(0.01)
        try:
            self.outcome = await fenced_insert(fence, dsn, table)
        except Exception as exc:
            self.outcome = exc
        finally:
            self.done.set()

    def finish_sync(self, lock: LeaderLock, dsn: str, table: str) -> None:
        """In a thread: ``lock.fence_sync`` on a synchronous connection."""
        self.waiting.set()
        self.go.wait(30)
        try:
            with psycopg.connect(dsn, connect_timeout=5) as conn, conn.transaction():
                term = lock.fence_sync(conn)
                conn.execute(f"INSERT INTO {table} (term) VALUES (%s)".encode(), (term,))
            self.outcome = term
        except Exception as exc:
            self.outcome = exc
        finally:
            self.done.set()

    async def result(self) -> int | BaseException | None:
        self.go.set()
        await eventually(self.done.is_set, 15.0, "the unit finished")
        return self.outcome


async def outlive(how: str, unit: Unit, lock: LeaderLock, dsn: str, table: str) -> None:
    """The body of a leader task whose unit of work outlives its leadership ``how``."""
    if how == "shield":  # the usual "finish the batch" idiom
        await asyncio.shield(unit.finish(lock.fence, dsn, table))
    elif how == "thread":  # the task is cancelled, the thread goes on
        await asyncio.to_thread(unit.finish_sync, lock, dsn, table)
    else:  # "swallowed": the task catches its cancellation and carries on
        unit.waiting.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        await unit.finish(lock.fence, dsn, table)


# ---------------------------------------------------------------- leader tasks


@pytest.mark.parametrize(
    ("how", "rival"),
    [("shield", False), ("shield", True), ("thread", True), ("swallowed", True)],
    ids=["shield-direct", "shield-rival", "thread-rival", "swallowed-rival"],
)
async def test_a_leader_tasks_zombie_unit_is_fenced_after_the_lock_led_again(
    how: str,
    rival: bool,
    pg_dsn: str,
    fenced_lock: MakeLock,
    work_table: str,
    admin: Admin,
) -> None:
    """A leader task begins a unit under term T; the lock's session is terminated, and
    it leads again (T + 1; with a rival: the rival leads T + 1, this lock T + 2); then
    the unit, which outlived the task's cancellation, calls ``lock.fence(conn)``: it is
    refused (FencedError), nothing of it commits. A second task, started afresh under
    each leadership, commits under each current term."""
    work = work_table
    lock = fenced_lock()
    other = fenced_lock(retry_strategy=FixedInterval(10.0)) if rival else None
    tasks = LeaderTasks(lock, cancel_timeout_s=0.5)
    unit = Unit()

    @tasks.task
    async def zombie() -> None:
        if unit.waiting.is_set():
            return  # only the first leadership's run outlives it
        await outlive(how, unit, lock, pg_dsn, work)

    @tasks.task
    async def steady() -> None:  # normal work: fenced under the term it started in
        await fenced_insert(lock.fence, pg_dsn, work)

    try:
        await lock.start()
        assert await lock.wait_for_leadership(10)
        began = lock.term
        assert began is not None
        await eventually(unit.waiting.is_set, 10.0, "the unit began")
        assert await _wait_terms(admin, work, {began}) == [began]
        now = await lead_again(admin, lock, other)
        assert now == began + (2 if rival else 1)
        outcome = await unit.result()
        assert isinstance(outcome, FencedError), outcome
        assert str(began) in str(outcome)
        assert await _wait_terms(admin, work, {now}) == [began, now]  # not the zombie's
    finally:
        unit.go.set()
        await tasks.close()


async def _wait_terms(admin: Admin, table: str, expected: set[int]) -> list[int]:
    """The terms in ``table`` once all of ``expected`` are there (bounded)."""
    found: list[int] = []

    async def there() -> bool:
        found[:] = await terms_in(admin, table)
        return expected <= set(found)

    await eventually(there, 10.0, f"terms {sorted(expected)} written")
    return found


# ---------------------------------------------------------------- scheduled jobs


async def test_a_scheduler_jobs_zombie_unit_is_fenced_after_the_lock_led_again(
    pg_dsn: str,
    fenced_lock: MakeLock,
    work_table: str,
    admin: Admin,
) -> None:
    """A Scheduler job's run begins under T and shields the rest of its work; the lock
    loses its session, a rival leads, the lock leads again; the shielded unit's
    ``lock.fence(conn)`` is refused. The runs of the new leadership commit under its
    term."""
    work = work_table
    lock = fenced_lock()
    rival = fenced_lock(retry_strategy=FixedInterval(10.0))
    sched = Scheduler(lock)
    unit = Unit()
    runs: list[Run] = []

    @sched.every(seconds=0.5)
    async def job(run: Run) -> None:
        runs.append(run)
        if not unit.waiting.is_set():
            await asyncio.shield(unit.finish(lock.fence, pg_dsn, work))
        else:
            await fenced_insert(lock.fence, pg_dsn, work)

    try:
        await lock.start()
        await sched.start()
        assert await lock.wait_for_leadership(10)
        began = lock.term
        await eventually(unit.waiting.is_set, 10.0, "the first run began")
        assert runs[0].term == began
        now = await lead_again(admin, lock, rival)
        outcome = await unit.result()
        assert isinstance(outcome, FencedError), outcome
        assert str(began) in str(outcome)
        written = await _wait_terms(admin, work, {now})
        assert set(written) == {now}
        assert all(run.term == now for run in runs[1:])
    finally:
        unit.go.set()
        await sched.shutdown()


# ---------------------------------------------------------------- explicit forms


async def test_a_leadership_binds_its_term_to_a_block_and_its_tasks(
    pg_dsn: str,
    fenced_lock: MakeLock,
    work_table: str,
    admin: Admin,
) -> None:
    """``async with lock.leadership() as lead``: inside, ``lock.fence`` fences with
    ``lead.term``, and so does a task created there; once the lock has led again,
    ``lead.fence``, ``lock.fence(conn, term=lead.term)``, ``lock.fence`` inside the
    block and the task's fence are refused, while ``lock.fence`` outside any block (or
    with the new term) commits under the new term."""
    work = work_table
    lock = fenced_lock()
    await lock.start()
    assert await lock.wait_for_leadership(10)
    began = lock.term
    assert began is not None
    unit = Unit()
    async with lock.leadership() as lead:
        assert isinstance(lead, Leadership)
        assert (lead.term, lead.current, lead.owner) == (began, True, lock)
        assert lock.leadership() is lead
        spawned = asyncio.create_task(unit.finish(lock.fence, pg_dsn, work))
    assert lock.leadership() is not lead  # outside the block: the current one
    await eventually(unit.waiting.is_set, 10.0, "the task began")
    now = await lead_again(admin, lock)
    assert not lead.current
    assert lock.leadership().term == now
    outcome = await unit.result()
    await spawned
    assert isinstance(outcome, FencedError), outcome
    with pytest.raises(FencedError, match=f"term {began}, under which"):
        await fenced_insert(lead.fence, pg_dsn, work)
    with pytest.raises(FencedError, match=f"term {began}, under which"):
        await fenced_insert(lambda conn: lock.fence(conn, term=began), pg_dsn, work)
    with lead, pytest.raises(FencedError, match=f"term {began}, under which"):
        await fenced_insert(lock.fence, pg_dsn, work)
    assert await fenced_insert(lock.fence, pg_dsn, work) == now
    assert await fenced_insert(lambda conn: lock.fence(conn, term=now), pg_dsn, work) == now
    assert await terms_in(admin, work) == [now, now]


async def test_a_lock_restarted_from_bound_work_leads_under_its_new_term(
    fenced_lock: MakeLock,
) -> None:
    """Work bound to term T shuts the lock down and starts it again (as a give-away of
    ``LeaderTasks`` does from a leader task): the lock's own callbacks do not inherit
    the binding, so they see the new leadership, not T."""
    lock = fenced_lock()
    seen: list[int] = []

    @lock.on_acquired
    def acquired() -> None:
        seen.append(lock.leadership().term)

    await lock.start()
    assert await lock.wait_for_leadership(10)
    began = lock.term
    assert began is not None
    async with lock.leadership():
        await lock.shutdown()
        await lock.start()
    assert await lock.wait_for_leadership(10)
    await eventually(lambda: len(seen) == 2, 10.0, "the second on_acquired")
    assert seen == [began, lock.term]
    assert began != lock.term


def test_a_thread_of_a_threaded_lock_keeps_the_term_it_began_under(
    pg_dsn: str, fencing_table: str, work_table: str
) -> None:
    """A thread binds the current leadership (``with lock.leadership():``) and begins a
    unit; the lock's session is terminated and it leads again; the unit's
    ``lock.fence(conn)`` is refused; a fence outside the binding commits under the new
    term."""
    terms_table, work = fencing_table, work_table
    inner = LeaderLock.from_name(
        unique("test-zombie-threaded"),
        pg_dsn,
        **lock_args(TIMINGS, options=LockOptions(fencing=Fencing(enabled=True, table=terms_table))),
    )
    unit = Unit()

    def begin(lock: ThreadedLeaderLock) -> None:
        try:
            with lock.leadership():
                unit.waiting.set()
                unit.go.wait(30)
                with psycopg.connect(pg_dsn, connect_timeout=5) as conn, conn.transaction():
                    unit.outcome = lock.fence(conn)
                    conn.execute(f"INSERT INTO {work} (term) VALUES (0)".encode())
        except Exception as exc:
            unit.outcome = exc

    with ThreadedLeaderLock(inner) as lock, psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert lock.wait_for_leadership(10)
        began = lock.term
        assert began is not None
        thread = threading.Thread(target=begin, args=(lock,))
        thread.start()
        try:
            assert unit.waiting.wait(10)
            admin.execute("SELECT pg_terminate_backend(%s)", (inner.backend_pid,))
            eventually_sync(lambda: lock.is_leader and (lock.term or 0) > began, 15.0)
        finally:
            unit.go.set()
            thread.join(30)
        assert isinstance(unit.outcome, FencedError), unit.outcome
        with psycopg.connect(pg_dsn, connect_timeout=5) as conn, conn.transaction():
            assert lock.fence(conn) == lock.term
        cur = admin.execute(f"SELECT count(*) FROM {work}".encode())
        assert cur.fetchone() == (0,)


# ---------------------------------------------------------------- the server refuses


@pytest.mark.parametrize("moment", ["moved-on", "bumping"])
@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
async def test_a_refused_fence_aborts_the_transaction_on_the_server(
    driver: str,
    moment: str,
    pg_dsn: str,
    fenced_lock: MakeLock,
    fencing_table: str,
    work_table: str,
    admin: Admin,
) -> None:
    """The server, not only the client, refuses a fence whose term has moved on (or is
    being bumped by a new leadership): the statement fails, so the transaction is
    aborted, and a caller that swallows the FencedError still cannot commit its
    writes."""
    terms_table, work = fencing_table, work_table
    lock = fenced_lock()
    await lock.start()
    assert await lock.wait_for_leadership(10)
    term = lock.term
    bump = f"UPDATE {terms_table} SET term = term + 1 WHERE key1 = %s AND key2 = %s"
    insert = f"INSERT INTO {work} (term) VALUES ({term})"
    async with await psycopg.AsyncConnection.connect(pg_dsn, connect_timeout=5) as bumper:
        # as a newer leader's bump would (committed, or still in progress); this lock
        # does not know yet
        await bumper.execute(bump.encode(), lock.keys)
        if moment == "moved-on":
            await bumper.commit()
        if driver == "psycopg":
            async with await psycopg.AsyncConnection.connect(pg_dsn, connect_timeout=5) as conn:
                with contextlib.suppress(FencedError):  # a careless caller
                    await lock.fence(conn)
                with pytest.raises(psycopg.errors.InFailedSqlTransaction):
                    await conn.execute(insert.encode())
                await conn.commit()
        else:
            import asyncpg

            conn = await asyncpg.connect(pg_dsn, timeout=5)
            try:
                with pytest.raises(asyncpg.InFailedSQLTransactionError):
                    async with conn.transaction():
                        with contextlib.suppress(FencedError):
                            await lock.fence(conn)
                        await conn.execute(insert)
            finally:
                await conn.close()
        await bumper.rollback()
    assert await terms_in(admin, work) == []


# ---------------------------------------------------------------- the first fence

_FIRST_FENCE = """
import asyncio, sys, psycopg
from pgleaderlock.core.registry import fetch_row

async def main() -> None:
    async with await psycopg.AsyncConnection.connect(sys.argv[1], connect_timeout=5) as conn:
        async with conn.transaction():
            assert await fetch_row(conn, "SELECT 1", ()) == (1,)
    print(sorted(m for m in ("sqlalchemy", "asyncpg") if m in sys.modules))

asyncio.run(main())
"""


def test_the_first_fence_imports_only_its_connections_driver(pg_dsn: str) -> None:
    """A fence on a psycopg connection, the first in a process, does not import the
    other installed drivers (SQLAlchemy takes seconds on a busy machine, on the event
    loop of a leader whose lease keeps running)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FIRST_FENCE, pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
