"""Leader work started by the integrations fences with the leadership it began under: a
FastAPI leader task, and an APScheduler ``leader_only`` job run in a thread with a
``ThreadedLeaderLock``. Each begins a unit under term T that outlives the leadership;
the lock's session is terminated, a rival leads, the lock leads again; the unit's
``lock.fence(conn)`` is refused. (The core's entry points, the explicit forms and the
server's refusal: ``tests/server/test_fencing_leadership.py``.)"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from pgleaderlock import (
    FencedError,
    Fencing,
    FixedInterval,
    LeaderLock,
    LockOptions,
    ThreadedLeaderLock,
)
from pgleaderlock.integrations.apscheduler import current_term, leader_only
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.leadership import TIMINGS, fenced_insert, lead_again, terms_in
from support.poll import eventually
from support.server import Admin
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def fencing_lock(name: str, dsn: str, table: str, **kwargs: Any) -> LeaderLock:
    return LeaderLock.from_name(
        name,
        dsn,
        **lock_args(
            TIMINGS | kwargs, options=LockOptions(fencing=Fencing(enabled=True, table=table))
        ),
    )


async def test_a_fastapi_leader_tasks_shielded_unit_is_fenced_after_leading_again(
    pg_dsn: str, lock_name: str, fencing_table: str, work_table: str, admin: Admin
) -> None:
    """A ``@leader.task`` begins under T and shields the rest of its unit; after the
    loss, a rival's term and this replica's new term, the unit's ``lock.fence(conn)``
    is refused, while a leader task started afresh commits under each current term."""
    terms_table, work = fencing_table, work_table
    leader = LeaderLifespan(fencing_lock(lock_name, pg_dsn, terms_table))
    rival = fencing_lock(lock_name, pg_dsn, terms_table, retry_strategy=FixedInterval(10.0))
    lock = leader.lock
    waiting, go = asyncio.Event(), asyncio.Event()
    outcome: list[object] = []

    async def finish() -> None:
        waiting.set()
        await go.wait()
        try:
            outcome.append(await fenced_insert(lock.fence, pg_dsn, work))
        except Exception as exc:
            outcome.append(exc)

    @leader.task
    async def zombie() -> None:
        if not waiting.is_set():
            await asyncio.shield(finish())

    @leader.task
    async def steady() -> None:
        await fenced_insert(lock.fence, pg_dsn, work)

    app = FastAPI(lifespan=leader)
    try:
        async with LifespanManager(app):
            assert await lock.wait_for_leadership(10)
            began = lock.term
            assert began is not None
            await eventually(waiting.is_set, 10.0, "the unit began")
            await eventually(lambda: _has(admin, work, began), 10.0, "the first write")
            now = await lead_again(admin, lock, rival)
            assert now == began + 2
            go.set()
            await eventually(lambda: outcome, 10.0, "the unit finished")
            assert isinstance(outcome[0], FencedError), outcome
            await eventually(lambda: _has(admin, work, now), 10.0, "the new term's write")
            assert await terms_in(admin, work) == [began, now]
    finally:
        go.set()
        await rival.shutdown()


async def _has(admin: Admin, table: str, term: int) -> bool:
    return term in await terms_in(admin, table)


async def test_a_leader_only_job_in_a_thread_keeps_its_runs_term(
    pg_dsn: str, lock_name: str, fencing_table: str, work_table: str, admin: Admin
) -> None:
    """A sync ``leader_only`` job of a ThreadedLeaderLock, run in a thread as
    ``BackgroundScheduler`` runs it, begins under T; the lock loses its session, a
    rival leads, the lock leads again; the job's ``lock.fence(conn)`` is refused (it
    fences with its run's term, ``current_term()``), a new run commits under the new
    term."""
    terms_table, work = fencing_table, work_table
    lock = ThreadedLeaderLock(fencing_lock(lock_name, pg_dsn, terms_table))
    rival = fencing_lock(lock_name, pg_dsn, terms_table, retry_strategy=FixedInterval(10.0))
    waiting, go = threading.Event(), threading.Event()
    outcome: list[object] = []

    @leader_only(lock)
    def job(wait: bool) -> None:
        if wait:
            waiting.set()
            go.wait(30)
        try:
            with psycopg.connect(pg_dsn, connect_timeout=5) as conn, conn.transaction():
                term = lock.fence(conn)
                assert term == current_term()
                conn.execute(f"INSERT INTO {work} (term) VALUES (%s)".encode(), (term,))
            outcome.append(term)
        except Exception as exc:
            outcome.append(exc)

    await asyncio.to_thread(lock.start)
    thread = threading.Thread(target=job, args=(True,))
    try:
        assert await asyncio.to_thread(lock.wait_for_leadership, 10)
        began = lock.term
        assert began is not None
        thread.start()
        assert await asyncio.to_thread(waiting.wait, 10)
        now = await lead_again(admin, lock.lock, rival)
        go.set()
        await asyncio.to_thread(thread.join, 30)
        assert isinstance(outcome[0], FencedError), outcome
        assert str(began) in str(outcome[0])
        await asyncio.to_thread(job, False)  # the next run: the current term
        assert outcome[1:] == [now]
        assert await terms_in(admin, work) == [now]
    finally:
        go.set()
        if thread.is_alive():
            await asyncio.to_thread(thread.join, 30)
        await rival.shutdown()
        await asyncio.to_thread(lock.shutdown, 15)
