"""The APScheduler integration in one process: ``leader_only`` (skip on followers, cancel
a coroutine run on loss), ``bind_scheduler`` (pause/resume, no replay of the previous
leader's runs), ``ThreadedLeaderLock`` with ``BackgroundScheduler`` on a real server."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import inspect
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_SCHEDULER_PAUSED,
    EVENT_SCHEDULER_RESUMED,
    JobExecutionEvent,
)
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING
from apscheduler.triggers.interval import IntervalTrigger

from pgleaderlock import (
    ConfigurationError,
    Fencing,
    LeaderLock,
    LockOptions,
    LockState,
    ThreadedLeaderLock,
)
from pgleaderlock.integrations.apscheduler import (
    SchedulerBinding,
    bind_scheduler,
    current_run,
    leader_only,
)
from pgleaderlock.schedule import Policy
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock
from support.poll import eventually, eventually_sync
from support.timings import lock_args, timings

S = LockState
pytestmark = pytest.mark.timeout(60)


def messages(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(event)]


@pytest.fixture
async def leader_and_follower(
    make_lock: MakeLock,
) -> tuple[LeaderLock, LeaderLock]:
    a, b = make_lock(), make_lock()
    await a.start()
    assert await a.wait_for_leadership(5)
    await b.start()
    await eventually(lambda: b.state in (S.FOLLOWER, S.ACQUIRING))
    return a, b


@pytest.fixture
async def scheduler() -> AsyncIterator[AsyncIOScheduler]:
    sched = AsyncIOScheduler()
    yield sched
    if sched.running:
        sched.shutdown(wait=False)
        await asyncio.sleep(0.01)  # its shutdown runs on the loop


# ---------------------------------------------------------------------- leader_only


async def test_leader_only_runs_on_the_leader_and_skips_on_a_follower(
    leader_and_follower: tuple[LeaderLock, LeaderLock], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    a, b = leader_and_follower

    def sync_job(x: int) -> int:
        return x * 2

    async def async_job(x: int) -> int:
        return x * 3

    assert leader_only(a)(sync_job)(2) == 4
    assert await leader_only(a)(async_job)(2) == 6
    assert leader_only(b)(sync_job)(2) is None
    assert await leader_only(b)(async_job)(2) is None
    skipped = messages(caplog, "job_skipped")
    assert len(skipped) == 2
    assert 'reason="not leader"' in skipped[0]
    wrapped = leader_only(a)(async_job)
    assert inspect.iscoroutinefunction(wrapped)  # AsyncIOScheduler runs it on the loop
    assert wrapped.__name__ == "async_job"
    with pytest.raises(ConfigurationError):
        leader_only(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^leader_only needs a callable"):
        leader_only(a)(42)  # type: ignore[call-overload]


async def test_leader_only_cancels_a_coroutine_run_when_leadership_is_lost(
    make_lock: MakeLock, server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = make_lock()
    await lock.start()
    assert await lock.wait_for_leadership(5)
    started = asyncio.Event()
    state_at_cancel: list[LockState] = []

    @leader_only(lock)
    async def long_job() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            state_at_cancel.append(lock.state)
            raise
        return "done"

    run = asyncio.create_task(long_job())
    await started.wait()
    server.terminate()  # the server frees the lock behind our back
    assert await asyncio.wait_for(run, 10) is None
    assert state_at_cancel
    assert state_at_cancel[0] is not S.LEADER
    assert len(messages(caplog, "job_cancelled")) == 1


async def test_leader_only_lets_the_schedulers_own_cancellation_through(
    make_lock: MakeLock,
) -> None:
    lock = make_lock()
    await lock.start()
    assert await lock.wait_for_leadership(5)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    @leader_only(lock)
    async def long_job() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    run = asyncio.create_task(long_job())
    await started.wait()
    run.cancel()  # what AsyncIOExecutor.shutdown() does
    with pytest.raises(asyncio.CancelledError):
        await run
    assert cancelled.is_set()
    assert lock.is_leader


async def test_leader_only_job_cancelled_under_asyncio_scheduler_is_not_an_error(
    make_lock: MakeLock, server: FakeServer, scheduler: AsyncIOScheduler
) -> None:
    lock = make_lock()
    errors: list[JobExecutionEvent] = []
    executed: list[JobExecutionEvent] = []
    scheduler.add_listener(errors.append, EVENT_JOB_ERROR)
    scheduler.add_listener(executed.append, EVENT_JOB_EXECUTED)
    started = asyncio.Event()

    @leader_only(lock)
    async def long_job() -> None:
        started.set()
        await asyncio.Event().wait()

    await lock.start()
    assert await lock.wait_for_leadership(5)
    scheduler.add_job(long_job, "date", run_date=dt.datetime.now(dt.UTC))
    scheduler.start()
    async with asyncio.timeout(10):
        await started.wait()
    server.terminate()
    await eventually(lambda: executed)
    assert errors == []
    assert executed[0].retval is None


# ---------------------------------------------------------------------- bind_scheduler


async def test_bound_scheduler_is_paused_on_a_follower_and_resumed_on_the_leader(
    leader_and_follower: tuple[LeaderLock, LeaderLock], scheduler: AsyncIOScheduler
) -> None:
    a, b = leader_and_follower
    events: list[str] = []
    scheduler.add_listener(lambda e: events.append("paused"), EVENT_SCHEDULER_PAUSED)
    scheduler.add_listener(lambda e: events.append("resumed"), EVENT_SCHEDULER_RESUMED)
    runs: list[float] = []
    scheduler.add_job(lambda: runs.append(time.time()), "interval", seconds=0.05)
    binding = bind_scheduler(scheduler, b, ledger=False)  # before start: pauses on start
    scheduler.start()
    assert scheduler.state == STATE_PAUSED
    assert not binding.active
    await asyncio.sleep(0.3)  # kept: six intervals, for a wrong run to show
    assert runs == []

    await a.shutdown()  # b takes over
    await eventually(lambda: len(runs) >= 3)
    assert binding.active
    assert events == ["paused", "resumed"]

    await b.step_down()  # no competitor: b pauses, then leads again
    await eventually(lambda: events.count("resumed") == 2)
    assert events == ["paused", "resumed", "paused", "resumed"]
    await b.shutdown()
    assert scheduler.state == STATE_PAUSED


async def test_bind_after_start_pauses_at_once(
    leader_and_follower: tuple[LeaderLock, LeaderLock], scheduler: AsyncIOScheduler
) -> None:
    _, b = leader_and_follower
    runs: list[float] = []
    scheduler.add_job(lambda: runs.append(time.time()), "interval", seconds=0.05)
    scheduler.start()
    bind_scheduler(scheduler, b, ledger=False)
    assert scheduler.state == STATE_PAUSED
    await asyncio.sleep(0.2)  # kept: four intervals, for a wrong run to show
    assert runs == []


@pytest.mark.parametrize("catch_up_s", [0.0, 30.0])
async def test_resume_does_not_replay_the_previous_leaders_runs(
    leader_and_follower: tuple[LeaderLock, LeaderLock],
    scheduler: AsyncIOScheduler,
    catch_up_s: float,
) -> None:
    a, b = leader_and_follower
    scheduled: list[dt.datetime] = []
    scheduler.add_listener(lambda e: scheduled.append(e.scheduled_run_time), EVENT_JOB_EXECUTED)
    trigger = IntervalTrigger(seconds=0.1, start_date=dt.datetime.now(dt.UTC))
    # The settings that would replay every run time that fell due while paused:
    scheduler.add_job(lambda: None, trigger, coalesce=False, misfire_grace_time=None)
    scheduler.add_job(lambda: None, "cron", second="*", coalesce=False, misfire_grace_time=None)
    bind_scheduler(scheduler, b, ledger=False, catch_up_s=catch_up_s)
    scheduler.start()
    await asyncio.sleep(0.6)  # ~6 run times fall due while b follows (a "runs" them)
    assert scheduled == []

    await a.shutdown()
    assert await b.wait_for_leadership(5)
    assert b.leader_since is not None
    took_over = dt.datetime.fromtimestamp(b.leader_since, dt.UTC)
    await eventually(lambda: len(scheduled) >= 3)
    before = [t for t in scheduled if t < took_over]
    if catch_up_s:
        assert len(before) >= 4  # replayed, as misfire_grace_time=None asks
    else:
        assert before == []  # each of those belonged to the previous leader


async def test_a_date_job_that_passed_while_following_is_dropped(
    leader_and_follower: tuple[LeaderLock, LeaderLock], scheduler: AsyncIOScheduler
) -> None:
    a, b = leader_and_follower
    runs: list[str] = []
    scheduler.add_job(
        lambda: runs.append("ran"),
        "date",
        run_date=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.1),
        misfire_grace_time=None,
        id="once",
    )
    bind_scheduler(scheduler, b, ledger=False)
    scheduler.start()
    await asyncio.sleep(0.3)
    await a.shutdown()
    assert await b.wait_for_leadership(5)
    await asyncio.sleep(0.2)
    assert runs == []
    assert scheduler.get_job("once") is None


async def test_binding_close_and_validation(
    leader_and_follower: tuple[LeaderLock, LeaderLock], scheduler: AsyncIOScheduler
) -> None:
    _, b = leader_and_follower
    binding = bind_scheduler(scheduler, b, ledger=False)
    binding.close()
    scheduler.start()
    assert scheduler.state == STATE_RUNNING  # no longer bound
    with pytest.raises(ConfigurationError):
        bind_scheduler(scheduler, b, ledger=False, catch_up_s=-1)
    with pytest.raises(ConfigurationError):
        bind_scheduler(object(), b, ledger=False)
    # The ledger (the default) claims runs under the fencing term: it needs fencing.
    with pytest.raises(ConfigurationError, match=r"fencing=True.*ledger=False"):
        bind_scheduler(scheduler, b)


async def test_ledger_mode_validates_its_arguments(
    make_lock: MakeLock, scheduler: AsyncIOScheduler
) -> None:
    lock = make_lock(fencing=True)
    with pytest.raises(ConfigurationError, match="catch_up_s belongs to"):
        bind_scheduler(scheduler, lock, catch_up_s=5)
    with pytest.raises(ConfigurationError, match="catch_up must be"):
        bind_scheduler(scheduler, lock, policy=Policy(catch_up="some"))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="interrupted must be"):
        bind_scheduler(scheduler, lock, policy=Policy(interrupted="again"))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_catch_up"):
        bind_scheduler(scheduler, lock, policy=Policy(max_catch_up=0))
    binding = bind_scheduler(scheduler, lock)
    assert binding.ledger
    assert binding.schedule is not None
    assert binding.schedule.lock is lock
    binding.close()
    assert not bind_scheduler(scheduler, lock, ledger=False).ledger


def test_missing_apscheduler_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "apscheduler" or m.startswith("apscheduler.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "apscheduler", None)
    package = "pgleaderlock.integrations.apscheduler"
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install 'pgleaderlock\[apscheduler\]'"):
        importlib.import_module("pgleaderlock.integrations.apscheduler")


# ---------------------------------------------------------------------- threads, real server

FAST_PG = timings(retry_s=0.05, health_interval_s=0.2)
EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def lock_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pgleaderlock:")]


@pytest.mark.integration
def test_threaded_locks_with_background_schedulers(pg_dsn: str, lock_name: str) -> None:
    runs: list[tuple[str, str]] = []
    replicas: dict[str, tuple[ThreadedLeaderLock, BackgroundScheduler]] = {}
    try:
        for label in ("a", "b"):
            lock = ThreadedLeaderLock(
                LeaderLock.from_name(
                    lock_name,
                    **lock_args(
                        FAST_PG, dsn=pg_dsn, options=LockOptions(fencing=Fencing(enabled=True))
                    ),
                )
            )
            assert lock.wait_for_leadership(0) is False  # not started
            sched = BackgroundScheduler()

            def bound_job(label: str = label) -> None:
                runs.append(("bound", label))

            def guarded_job(label: str = label, lock: ThreadedLeaderLock = lock) -> None:
                runs.append(("leader_only", label))

            sched.add_job(bound_job, "interval", seconds=0.05, start_date=EPOCH, id="bound")
            other = BackgroundScheduler()
            other.add_job(leader_only(lock)(guarded_job), "interval", seconds=0.05)
            bind_scheduler(sched, lock)
            replicas[label] = (lock, sched)
            lock.start()
            lock.start()  # idempotent
            sched.start()
            other.start()
            replicas[label + "-other"] = (lock, other)

        a_lock, b_lock = replicas["a"][0], replicas["b"][0]
        eventually_sync(lambda: a_lock.is_leader or b_lock.is_leader, 20.0)
        first, second = ("a", "b") if a_lock.is_leader else ("b", "a")
        assert replicas[first][0].wait_for_leadership(5)
        eventually_sync(lambda: len(runs) >= 10, 20.0)
        assert {label for _, label in runs} == {first}
        assert {kind for kind, _ in runs} == {"bound", "leader_only"}

        replicas[first][0].step_down(timeout_s=10)  # from the main thread
        assert replicas[second][0].wait_for_leadership(20)
        mark = len(runs)
        eventually_sync(
            lambda: len({(k, lbl) for k, lbl in runs[mark + 2 :] if lbl == second}) == 2, 20.0
        )
        eventually_sync(lambda: len(runs) >= mark + 20, 20.0)
        assert {label for _, label in runs[-10:]} == {second}
    finally:
        for _, sched in replicas.values():
            if sched.running:
                sched.shutdown(wait=True)
        for lock, _ in replicas.values():
            lock.shutdown(timeout_s=10)
            lock.shutdown()  # idempotent
    for lock, _ in replicas.values():
        assert lock.state is S.STOPPED
        assert not lock.running
        assert lock.wait_for_leadership(0) is False
    assert lock_threads() == []


@pytest.mark.integration
def test_threaded_lock_refuses_shutdown_from_its_own_thread(pg_dsn: str, lock_name: str) -> None:
    threaded = ThreadedLeaderLock(LeaderLock.from_name(lock_name, **lock_args(FAST_PG, dsn=pg_dsn)))
    errors: list[BaseException] = []

    @threaded.lock.on_acquired
    def acquired() -> None:
        try:
            threaded.shutdown()
        except RuntimeError as exc:
            errors.append(exc)

    with threaded:
        assert threaded.wait_for_leadership(20)
        assert threaded.loop is not None
        eventually_sync(lambda: bool(errors), 20.0)
    assert "own thread" in str(errors[0])
    assert threaded.loop is None
    assert lock_threads() == []
    errors.clear()
    with threaded:  # it starts again, on a new thread and event loop
        assert threaded.wait_for_leadership(20)
        eventually_sync(lambda: bool(errors), 20.0)
    assert not threaded.running
    assert lock_threads() == []


@pytest.mark.integration
@pytest.mark.parametrize("lead_first", [False, True], ids=["start-first", "lead-first"])
@pytest.mark.parametrize(
    ("catch_up", "ran", "missed"), [("none", 0, 5), ("latest", 1, 4), ("all", 5, 0)]
)
async def test_catch_up_of_the_slots_nobody_ran(
    pg_dsn: str, lock_name: str, catch_up: str, ran: int, missed: int, lead_first: bool
) -> None:
    """Nobody leads for 5 slots (0.25 s apart), older than the job's 1 s misfire grace
    when the next leader looks: ``catch_up`` decides which of them run, and the ledger
    records the others as missed; each slot that runs learns it through
    ``current_run()``. The next leader's scheduler starts before its lock leads, or
    after. How soon the next leader looks is the machine's: a slot after the gap may
    be past its grace by then too, and is then one of the slots nobody ran."""
    interval = dt.timedelta(seconds=0.25)
    slots: list[dt.datetime] = []
    late: dict[dt.datetime, float] = {}  # how late each run started (server clock)

    async def job() -> None:
        run = current_run()
        slots.append(run.slot)
        late[run.slot] = run.late_s

    async def lead_while(condition: Callable[[], bool]) -> SchedulerBinding:
        lock = LeaderLock.from_name(
            lock_name,
            **lock_args(FAST_PG, dsn=pg_dsn, options=LockOptions(fencing=Fencing(enabled=True))),
        )
        sched = AsyncIOScheduler()
        trigger = IntervalTrigger(seconds=0.25, start_date=EPOCH)
        sched.add_job(job, trigger, id="tick", misfire_grace_time=1)
        binding = bind_scheduler(sched, lock, policy=Policy(catch_up=catch_up))  # type: ignore[arg-type]
        if not lead_first:
            sched.start()
        async with lock:
            if lead_first:
                assert await lock.wait_for_leadership(20)
                sched.start()
            await eventually(condition, 20.0)
            sched.shutdown(wait=False)
        await asyncio.sleep(0.01)
        return binding

    binding = await lead_while(lambda: len(slots) >= 2)
    last = slots[-1]
    # Nobody leads from here until the slot 5 intervals later has passed its grace.
    await asyncio.sleep((last + 5 * interval - dt.datetime.now(dt.UTC)).total_seconds() + 1.1)
    before = len(slots)
    await lead_while(lambda: len(slots) >= before + ran + 2)
    assert binding.schedule is not None
    rows = {r[0]: r[3] for r in await query_ledger(pg_dsn, binding.schedule.schedule_name("tick"))}
    gap = [last + i * interval for i in range(1, 6)]
    # The slots nobody ran on time: each is either caught up (run past the 1 s grace)
    # or recorded missed; together they are the slots right after the gap's start.
    caught = [s for s in slots[before:] if late[s] > 1.0]
    skipped = sorted(s for s, outcome in rows.items() if outcome == "missed" and s > last)
    behind = sorted(caught + skipped)
    assert behind == [last + i * interval for i in range(1, len(behind) + 1)], (slots, rows)
    assert behind[:5] == gap, (slots, rows)
    if catch_up == "none":
        assert caught == [], (slots, rows)
    elif catch_up == "latest":
        assert caught == behind[-1:], (slots, rows)  # the newest, the older ones missed
    else:
        assert skipped == [], (slots, rows)
    assert len(caught) >= ran, (slots, rows)
    assert len(skipped) >= missed, (slots, rows)
    assert len(slots) == len(set(slots))
    assert all(rows[s] == "done" for s in caught), rows
    # A run that the scheduler's shutdown cancelled stays running; the next leader
    # records it lost (interrupted="lost").
    assert all(rows[s] in ("done", "lost") for s in slots[:before]), rows
    # The second leadership's last runs may be cut by the shutdown that ends the test
    # (their finish needs the lock's session): no next leader has recorded them lost.
    assert all(rows[s] in ("done", "running") for s in slots[before:]), rows


async def query_ledger(pg_dsn: str, schedule: str) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT slot, term, holder, outcome FROM public.pgleaderlock_runs"
            " WHERE schedule = %s ORDER BY slot",
            (schedule,),
        )
        return await cur.fetchall()


@pytest.mark.integration
async def test_an_async_jobs_claim_past_its_bound_is_skipped_in_one_line(
    pg_dsn: str, lock_name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A coroutine job of a bound AsyncIOScheduler claims its slot on the lock's loop (a
    ThreadedLeaderLock's); that loop is blocked past the claim's bound: the run is
    skipped with one ``job_skipped`` line, as a sync job's is, not raised into
    APScheduler as a job error with a traceback, nor reported as executed (its slot is
    left to the next leader's settling)."""
    import pgleaderlock.integrations.apscheduler.ledger as integration

    monkeypatch.setattr(integration, "LEDGER_TIMEOUT_S", 0.3)
    caplog.set_level(logging.INFO)
    ran: list[dt.datetime] = []
    errors: list[JobExecutionEvent] = []

    async def job() -> None:
        ran.append(current_run().slot)

    threaded = ThreadedLeaderLock(
        LeaderLock.from_name(
            lock_name,
            **lock_args(FAST_PG, dsn=pg_dsn, options=LockOptions(fencing=Fencing(enabled=True))),
        )
    )
    sched = AsyncIOScheduler()
    sched.add_job(job, IntervalTrigger(seconds=0.5, start_date=EPOCH), id="tick")
    sched.add_listener(errors.append, EVENT_JOB_ERROR)
    executed: list[dt.datetime] = []
    sched.add_listener(lambda e: executed.append(e.scheduled_run_time), EVENT_JOB_EXECUTED)
    bind_scheduler(sched, threaded)
    with threaded:
        assert threaded.wait_for_leadership(20)
        sched.start()
        try:
            await eventually(lambda: bool(ran), 20.0)
            loop = threaded.loop
            assert loop is not None
            loop.call_soon_threadsafe(time.sleep, 1.2)  # the next claim waits past 0.3 s
            await eventually(lambda: bool(messages(caplog, "job_skipped")), 10.0)
            await asyncio.sleep(1.5)
        finally:
            sched.shutdown(wait=False)
            await asyncio.sleep(0.01)
    skipped = messages(caplog, "job_skipped")
    assert any("a ledger call took over 0.3 s" in m for m in skipped), skipped
    assert errors == []
    ran_at = {round(slot.timestamp(), 3) for slot in ran}
    assert executed, "no run was heard of"
    assert {round(t.timestamp(), 3) for t in executed} <= ran_at, (executed, ran)
