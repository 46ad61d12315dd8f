"""Scheduled work on every backend: each slot claimed once in the ledger, under the
fencing term, at the server's time; the catch-up and interrupted policies; the job's
fenced transaction on each driver's own connections.

The policies (catch-up, interrupted runs, step-downs) are the same SQL on every backend:
``tests/server/test_schedule_policies.py``. The long fault runs (replica processes
killed, stopped and terminated at random phases for two minutes) are in
``tests/soak/test_schedule_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import psycopg
import pytest

from pgleaderlock import FencedError
from pgleaderlock.schedule import Policy, Run, Scheduler, SlotGuard
from support.poll import eventually
from support.schedule import ledger, sched_every
from support.server import Admin

if TYPE_CHECKING:
    from contract.conftest import Target

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.postgres_only("the ledger is SQL on the server"),
]


@contextlib.asynccontextmanager
async def sink_connection(target: Target, pg_dsn: str) -> AsyncIterator[object]:
    """A connection of the flavour's own driver, outside any transaction."""
    backend = target.flavour.backend
    if backend == "asyncpg":
        import asyncpg

        conn = await asyncpg.connect(pg_dsn)
        try:
            yield conn
        finally:
            await conn.close()
    elif backend == "sqlalchemy":
        from sqlalchemy.ext.asyncio import create_async_engine

        from support.server import dsn_to_url

        engine = create_async_engine(dsn_to_url(pg_dsn, "postgresql+psycopg"))
        try:
            async with engine.connect() as conn:
                yield conn
        finally:
            await engine.dispose()
    else:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            yield conn


async def execute(conn: object, sql: str, *values: object) -> None:
    """``sql`` with ``$1``-style parameters on any of the drivers' connections."""
    if isinstance(conn, psycopg.AsyncConnection):
        await conn.execute(sql.replace("$1", "%s").replace("$2", "%s"), values)
        return
    try:
        from sqlalchemy import text
        from sqlalchemy.ext.asyncio import AsyncConnection
    except ImportError:  # pragma: no cover
        AsyncConnection = None  # type: ignore[assignment,misc]
    if AsyncConnection is not None and isinstance(conn, AsyncConnection):
        named = sql.replace("$1", ":a").replace("$2", ":b")
        await conn.execute(text(named), dict(zip("ab", values, strict=False)))
        return
    await conn.execute(sql, *values)  # type: ignore[attr-defined]


async def test_each_slot_runs_once_at_the_servers_time_in_a_fenced_transaction(
    target: Target, keys: tuple[int, int], admin: Admin, pg_dsn: str
) -> None:
    """Slots of an every-second schedule run one after the other; each run's writes go
    through ``run.transaction`` on the driver's own connection, which marks the slot
    done in the same commit; no slot starts before its time on the server's clock."""
    sink = f"sched_sink_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE TABLE {sink} (slot timestamptz, term int8)")
    lock = target.lock(keys, fencing=True)
    sched = Scheduler(lock)
    runs: list[Run] = []
    try:
        async with sink_connection(target, pg_dsn) as conn:

            @sched.every(seconds=1)
            async def tick(run: Run) -> None:
                runs.append(run)
                async with run.transaction(conn) as term:
                    await execute(conn, f"INSERT INTO {sink} VALUES ($1, $2)", run.slot, term)

            async with lock, sched:
                await lock.wait_for_leadership(10)
                await eventually(lambda: sum(run.done for run in runs) >= 3, 10)
    finally:
        rows = await ledger(admin, sched.schedule_name("tick"))
        written = await (await admin.execute(f"SELECT slot, term FROM {sink}")).fetchall()
        await admin.execute(f"DROP TABLE {sink}")
    runs = [run for run in runs if run.done]  # (not one cancelled by the shutdown)
    assert len(runs) >= 3
    slots = [run.slot for run in runs]
    assert slots == sorted(set(slots))
    assert all((b - a) == dt.timedelta(seconds=1) for a, b in itertools.pairwise(slots))
    by_slot = {row[0]: row for row in rows}
    for run in runs:
        row = by_slot[run.slot]
        assert row[1] == run.term
        assert row[2] == "done"
        assert row[3] == 1
        assert row[4] >= run.slot  # started at (or after) its time, by the server's clock
    assert sorted(written) == sorted((run.slot, run.term) for run in runs)


async def test_a_failing_job_rolls_back_and_is_recorded_failed(
    target: Target, keys: tuple[int, int], admin: Admin, pg_dsn: str
) -> None:
    sink = f"sched_sink_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE TABLE {sink} (slot timestamptz)")
    lock = target.lock(keys, fencing=True)
    sched = Scheduler(lock)
    attempts: list[Run] = []
    try:
        async with sink_connection(target, pg_dsn) as conn:

            @sched.every(seconds=1)
            async def broken(run: Run) -> None:
                attempts.append(run)
                async with run.transaction(conn):
                    await execute(conn, f"INSERT INTO {sink} VALUES ($1)", run.slot)
                    raise RuntimeError("disk full")

            async with lock, sched:
                await eventually(lambda: len(attempts) >= 2, 10)
                await asyncio.sleep(0.2)
                assert lock.is_leader  # a failing job does not cost the leadership
    finally:
        rows = await ledger(admin, sched.schedule_name("broken"))
        written = await (await admin.execute(f"SELECT count(*) FROM {sink}")).fetchone()
        await admin.execute(f"DROP TABLE {sink}")
    assert written == (0,)
    failed = [row for row in rows if row[2] == "failed"]
    assert len(failed) >= 1
    assert failed[0][6] == "RuntimeError: disk full"


async def test_an_old_terms_transaction_cannot_mark_a_slot_done(
    target: Target, keys: tuple[int, int], admin: Admin, pg_dsn: str
) -> None:
    """A run that outlives its leadership (the job kept a Run object) cannot commit
    through ``run.transaction``: the fence refuses the old term."""
    kept: list[Run] = []
    lock = target.lock(keys, fencing=True)
    sched = Scheduler(lock)

    async def once(run: Run) -> None:
        kept.append(run)

    sched.add(
        once, sched_every(3600, first_in_s=1), name="once", policy=Policy(misfire_grace_s=3600)
    )
    async with lock, sched:
        await eventually(lambda: len(kept) >= 1)
        await lock.step_down()
        await eventually(lambda: lock.is_leader)  # a new term
    run = kept[0]
    async with sink_connection(target, pg_dsn) as conn:
        with pytest.raises(FencedError):
            async with run.transaction(conn):
                pass


async def test_the_work_a_slot_hands_over_begins_once_however_many_copies(
    target: Target, keys: tuple[int, int], admin: Admin
) -> None:
    """A job hands its slots over (``outcome="sent"``, as Celery beat does), and copies
    of a slot's work reach workers that ask a ``SlotGuard`` first: of 8 copies at once,
    one begins; a slot left ``running`` by a leader that died before recording the send
    begins once, and a rerun by the next leader cannot take it over then; a slot with
    no row, or recorded ``missed``, does not begin."""
    lock = target.lock(keys, fencing=True)
    sched = Scheduler(lock)
    sent: list[Run] = []

    async def send(run: Run) -> None:
        sent.append(run)

    job = sched.add(send, sched_every(1), name="send", outcome="sent")
    guard = SlotGuard(target.dsn(), backend=target.flavour.backend, worker="w1")
    name = sched.schedule_name("send")
    async with lock, sched:
        await eventually(lambda: len(sent) >= 1, 10)
        await eventually(lambda: len(sent) >= 2, 10)  # the first one's row is final
        first = sent[0].slot
        copies = await asyncio.gather(*(guard.admit(name, first) for _ in range(8)))
        assert sorted(copies) == [False] * 7 + [True]
        # A leader claimed this slot and died before the send was recorded:
        orphan = first - dt.timedelta(seconds=30)
        run = await sched.claim(job, orphan)
        assert run is not None
        assert await guard.admit(name, orphan)
        await lock.step_down()
        await eventually(lambda: lock.is_leader)  # the next term
        assert await sched.claim(job, orphan, rerun=True) is None  # it began: no resend
        assert not await guard.admit(name, orphan)
    rows = {row[0]: row for row in await ledger(admin, name)}
    assert rows[first][2] == "executed"
    assert rows[first][6] == "by w1"
    assert rows[orphan][2] == "executed"
    assert not await guard.admit(name, first - dt.timedelta(seconds=31))  # no row
    await admin.execute(
        "INSERT INTO public.pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
        " VALUES (%s, %s, 1, 'missed', now())",
        (name, first - dt.timedelta(seconds=32)),
    )
    assert not await guard.admit(name, first - dt.timedelta(seconds=32))
