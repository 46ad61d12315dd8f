"""Every long-running loop survives a transient error: a Coordinator's join, a
Scheduler's ledger statements.

A transient error (a statement held up by another session's lock past its bound, a
terminated backend) is retried with the retry strategy; only errors that retrying cannot
mend (authentication, configuration, missing privileges, untrusted objects) end a loop,
and then loudly.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from typing import Any

import psycopg
import pytest

from pgleaderlock import (
    Coordinator,
    Fencing,
    LeaderLock,
    LeaderTasks,
    LockOptions,
    WorkerContext,
    lock_keys,
)
from pgleaderlock.core.tables import TermTable
from pgleaderlock.schedule import Policy, Run, Scheduler
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KNOBS: dict[str, Any] = timings(
    retry_s=0.1,
    health_interval_s=0.5,
    health_timeout_s=0.5,
    connect_timeout_s=2.0,
    load_plugins=False,
)
HOLD_S = 4.0


@pytest.mark.parametrize("sessions", ["dedicated", "shared"])
async def test_a_coordinator_whose_join_is_held_joins_once_the_hold_ends(
    sessions: str, pg_dsn: str, schema: str
) -> None:
    """Another session's uncommitted ``CREATE TABLE`` of the fencing table holds the
    member's first statements (its table checks) for 4 s, far past their bound
    (``health_timeout_s``): the member retries, and once the hold ends it joins and
    runs every name within 2 s; it never stops."""
    names = [f"n{i}" for i in range(3)]
    running: dict[str, float] = {}

    async def worker(ctx: WorkerContext) -> None:
        running.setdefault(ctx.name, time.monotonic())
        await asyncio.Event().wait()

    coord = Coordinator(
        pg_dsn,
        **lock_args(
            KNOBS,
            group=f"held-{uuid.uuid4().hex[:8]}",
            sessions=sessions,
            balance_interval_s=0.1,
            options=LockOptions(fencing=Fencing(enabled=True, schema=schema)),
        ),
    )
    for name in names:
        coord.add(name, worker)
    table = TermTable(schema=schema)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as holder:
        await holder.execute(table.create.encode())  # in a transaction, not committed
        # start() returns once joined, or after the connection budget (6 s here)
        starting = asyncio.ensure_future(coord.start())
        try:
            await asyncio.sleep(HOLD_S)
            assert coord.started, f"the coordinator stopped: {coord.stop_error!r}"
            assert not running, "names ran before their table could be checked"
            await holder.commit()
            ended = time.monotonic()
            await starting
            deadline = ended + 10
            while set(running) != set(names):
                assert coord.started, f"the coordinator stopped: {coord.stop_error!r}"
                assert time.monotonic() < deadline, f"never ran every name: {coord.view()}"
                await asyncio.sleep(0.02)
            joined = max(running.values()) - ended
            print(f"{sessions}: every name runs {joined:.3f} s after the hold ended")
            assert joined <= 2.0
            assert coord.stop_error is None
        finally:
            starting.cancel()
            await coord.shutdown()


async def test_a_scheduler_statement_past_its_bound_is_one_line_and_the_slot_reruns(
    pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A job's run ends while another session holds the ledger's runs table (an open
    transaction with ``LOCK TABLE``): the Scheduler's ``finish`` statement runs past its
    bound ("session work timed out"), which costs the lock its session, and so do the
    statements of the next leaderships while the hold lasts. Another ``LeaderTasks`` on
    the lock, made first, has a task that takes a moment to stop. No record has a
    traceback (no "leader_task_crashed": the Scheduler's loop never runs on into "not
    leading" while the other task stops); the lock's line names the statement's own
    bound; once the hold ends the slot left ``running`` follows
    ``interrupted="rerun"``: it runs again, and is done."""
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = LeaderLock(pg_dsn, *lock_keys(f"held-{uuid.uuid4().hex[:8]}"), **lock_args(KNOBS, options=LockOptions(fencing=Fencing(enabled=True, schema=schema))))  # fmt: skip
    tasks = LeaderTasks(lock)  # first: its listener runs before the Scheduler's

    @tasks.task
    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)  # a graceful cleanup

    sched = Scheduler(lock, schema=schema, call_timeout_s=0.5)
    runs: list[tuple[dt.datetime, int]] = []
    held: list[dt.datetime] = []
    holder = await psycopg.AsyncConnection.connect(pg_dsn)

    @sched.every(0.5, policy=Policy(catch_up="all", interrupted="rerun"))
    async def job(run: Run) -> None:
        runs.append((run.slot, run.attempt))
        if not held and len(runs) >= 2:
            held.append(run.slot)  # its finish() waits for the table from here on
            await holder.execute(f"LOCK TABLE {schema}.pgleaderlock_runs".encode())

    try:
        async with lock, sched:
            assert await lock.wait_for_leadership(10)
            deadline = time.monotonic() + 10
            while not held:
                assert time.monotonic() < deadline, "the job never ran twice"
                await asyncio.sleep(0.05)
            await asyncio.sleep(HOLD_S / 2)  # the finish times out, then the next leaders'
            await holder.commit()
            slot = held[0]
            deadline = time.monotonic() + 10
            while (slot, 2) not in runs:
                assert time.monotonic() < deadline, f"the interrupted slot never reran: {runs}"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # its finish() is recorded
        await tasks.close()
    finally:
        await holder.close()
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        outcome = await admin.execute(
            f"SELECT outcome, attempt FROM {schema}.pgleaderlock_runs"
            " WHERE schedule = %s AND slot = %s".encode(),
            (sched.schedule_name("job"), slot),
        )
        assert await outcome.fetchall() == [("done", 2)]
    ours = [r for r in caplog.records if r.name.startswith("pgleaderlock")]
    traced = [r.getMessage() for r in ours if r.exc_info]
    assert traced == [], "a transient error was logged with a traceback"
    assert not [r for r in ours if "crashed" in r.getMessage()]
    lost = [r.getMessage() for r in ours if r.getMessage().startswith("health_check_failed")]
    assert any("session work timed out after 0.5 s" in m for m in lost), lost
