"""Scheduled work on every backend: each slot claimed once in the ledger, under the
fencing term, at the server's time; the catch-up and interrupted policies; the job's
fenced transaction on each driver's own connections.

The long fault runs (replica processes killed, stopped and terminated at random phases
for two minutes) are in ``tests/soak/test_schedule_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from pgleaderlock import FencedError, LeaderLock, LockState
from pgleaderlock.schedule import Every, Run, Scheduler

if TYPE_CHECKING:
    from conftest import Admin
    from contract.conftest import Target

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.postgres_only("the ledger is SQL on the server"),
]

LEDGER = (
    "SELECT slot, term, outcome, attempt, started_at, claimed_at, detail"
    " FROM public.pgleaderlock_runs WHERE schedule = %s ORDER BY slot"
)


async def ledger(admin: Admin, schedule: str) -> list[tuple[Any, ...]]:
    return await (await admin.execute(LEDGER, (schedule,))).fetchall()


async def until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


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
                await until(lambda: asyncio.sleep(0, sum(run.done for run in runs) >= 3), 10)
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
                await until(lambda: asyncio.sleep(0, len(attempts) >= 2), 10)
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


async def test_two_replicas_claim_each_slot_once_across_a_step_down(
    target: Target, keys: tuple[int, int], admin: Admin
) -> None:
    """Two schedulers on one lock (two replicas): the leader steps down between slots
    and the other takes over; every slot in the window has one row and one run."""
    runs: list[tuple[str, dt.datetime]] = []
    replicas = []
    for who in ("a", "b"):
        lock = target.lock(keys, fencing=True)
        sched = Scheduler(lock)

        async def job(run: Run, who: str = who) -> None:
            runs.append((who, run.slot))

        sched.add(job, sched_every(1), name="job")
        replicas.append((lock, sched))
    async with contextlib.AsyncExitStack() as stack:
        for lock, sched in replicas:
            await stack.enter_async_context(lock)
            await stack.enter_async_context(sched)
        for _ in range(3):
            await until(lambda: asyncio.sleep(0, any(lk.is_leader for lk, _ in replicas)))
            first = len(runs)
            await until(lambda first=first: asyncio.sleep(0, len(runs) >= first + 2), 10)
            leader = next(lk for lk, _ in replicas if lk.is_leader)
            await leader.step_down()
    rows = await ledger(admin, replicas[0][1].schedule_name("job"))
    slots = [slot for _, slot in runs]
    assert len(slots) == len(set(slots)), "a slot ran twice"
    assert {who for who, _ in runs} == {"a", "b"}
    recorded = [row[0] for row in rows]
    assert recorded == sorted(recorded)
    assert all(b - a == dt.timedelta(seconds=1) for a, b in itertools.pairwise(recorded))
    ran = set(slots)
    assert {row[0] for row in rows if row[2] in ("done", "running")} == ran
    assert [row for row in rows if row[2] == "missed"] == []  # step-downs are fast


def sched_every(seconds: float, first_in_s: float | None = None) -> Every:
    """Every ``seconds``; with ``first_in_s``, shifted so that a slot falls that soon."""
    if first_in_s is None:
        return Every(dt.timedelta(seconds=seconds))
    return Every(dt.timedelta(seconds=seconds), dt.timedelta(seconds=time.time() + first_in_s))


@pytest.mark.parametrize("policy", ["none", "latest", "all"])
async def test_slots_missed_while_nobody_led_follow_the_catch_up_policy(
    target: Target, keys: tuple[int, int], admin: Admin, policy: str
) -> None:
    """A schedule runs one slot, nobody leads for 2-3 slots, then a leader catches up:
    ``none`` records every missed slot, ``latest`` runs the newest of them, ``all`` runs
    them all (oldest first); the slots after that run on time."""
    name = f"catch-{policy}"
    ran: list[dt.datetime] = []

    def replica() -> tuple[LeaderLock, Scheduler]:
        lock = target.lock(keys, fencing=True)
        sched = Scheduler(lock)

        async def job(run: Run) -> None:
            ran.append(run.slot)

        sched.add(job, sched_every(1.0), name=name, catch_up=policy,  # type: ignore[arg-type]
                  misfire_grace_s=0.4)  # fmt: skip
        return lock, sched

    lock, sched = replica()
    async with lock, sched:
        await until(lambda: asyncio.sleep(0, len(ran) >= 1))
    # Nobody leads for 2-3 slots; the next leader starts 0.6 s into a slot's interval,
    # so the newest slot before it is past the grace (0.4 s), and the next one is on time
    # unless taking the lock takes 0.8 s.
    await asyncio.sleep(1.6)
    now = await (await admin.execute("SELECT extract(epoch FROM clock_timestamp())")).fetchone()
    assert now is not None
    await asyncio.sleep((0.6 - float(now[0]) % 1.0) % 1.0)
    takeover = dt.datetime.now(dt.UTC)  # (this host is the server's: same clock)
    lock, sched = replica()
    async with lock, sched:
        await until(lambda: asyncio.sleep(0, any(slot > takeover for slot in ran)))
    rows = await ledger(admin, sched.schedule_name(name))
    recorded = [row[0] for row in rows]
    assert all(b - a == dt.timedelta(seconds=1) for a, b in itertools.pairwise(recorded))
    assert len(ran) == len(set(ran))
    past = [slot for slot in recorded if ran[0] < slot < takeover]  # fell due while nobody led
    missed = [row[0] for row in rows if row[2] == "missed"]
    late = [slot for slot in ran if slot in past]
    assert len(past) >= 2
    expected = {"none": ([], past), "latest": (past[-1:], past[:-1]), "all": (past, [])}[policy]
    assert (late, missed) == expected
    # (the last run may have been cancelled by the shutdown: its row says running)
    assert set(ran) == {row[0] for row in rows if row[2] in ("done", "running")}
    assert max(ran) > takeover  # and then on time again


@pytest.mark.parametrize("interrupted", ["lost", "rerun"])
async def test_a_slot_whose_leader_ended_mid_run_is_lost_or_run_again(
    target: Target,
    keys: tuple[int, int],
    admin: Admin,
    interrupted: str,
) -> None:
    """The leader's session is terminated while a run is in progress: the run is
    cancelled with the leadership, its row stays ``running`` under the old term, and the
    next leader (a newer term) records it as lost, or runs it again, as told."""
    started: list[Run] = []
    hang = asyncio.Event()
    hourly = sched_every(3600, first_in_s=1)

    def replica() -> tuple[LeaderLock, Scheduler]:
        lock = target.lock(keys, fencing=True, auto_reacquire=False)
        sched = Scheduler(lock)

        async def job(run: Run) -> None:
            started.append(run)
            if len(started) == 1:
                await hang.wait()  # the first run never ends by itself

        sched.add(job, hourly, name="slow", interrupted=interrupted,  # type: ignore[arg-type]
                  catch_up="latest", misfire_grace_s=3600)  # fmt: skip
        return lock, sched

    first, first_sched = replica()
    async with first, first_sched:
        await until(lambda: asyncio.sleep(0, len(started) == 1))
        await admin.execute("SELECT pg_terminate_backend(%s)", (first.backend_pid,))
        await until(lambda: asyncio.sleep(0, not first.is_leader))
    assert first.state is LockState.STOPPED
    second, second_sched = replica()
    async with second, second_sched:
        await until(lambda: asyncio.sleep(0, second.is_leader and second.term != started[0].term))
        await asyncio.sleep(0.5)
    rows = await ledger(admin, second_sched.schedule_name("slow"))
    assert len(rows) == 1
    slot, term, outcome, attempt, *_ = rows[0]
    assert slot == started[0].slot
    if interrupted == "lost":
        assert (outcome, attempt, len(started)) == ("lost", 1, 1)
    else:
        assert (outcome, attempt, len(started)) == ("done", 2, 2)
        assert term == started[1].term > started[0].term


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

    sched.add(once, sched_every(3600, first_in_s=1), name="once", misfire_grace_s=3600)
    async with lock, sched:
        await until(lambda: asyncio.sleep(0, len(kept) >= 1))
        await lock.step_down()
        await until(lambda: asyncio.sleep(0, lock.is_leader))  # a new term
    run = kept[0]
    async with sink_connection(target, pg_dsn) as conn:
        with pytest.raises(FencedError):
            async with run.transaction(conn):
                pass
