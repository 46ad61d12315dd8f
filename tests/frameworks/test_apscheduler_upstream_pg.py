"""What APScheduler 3.x documents, and a bound scheduler must keep: the same test runs
against a plain ``BackgroundScheduler`` and a bound one (leading, a ``ThreadedLeaderLock``
on a real PostgreSQL server, in the guide's order: ``bind_scheduler(s, lock)``, then
``with lock: s.start()``), with the same assertion.

From APScheduler's user guide: a run time later than the job's ``misfire_grace_time`` is
not run, and its listeners get ``EVENT_JOB_MISSED``; a job added without a trigger (or
with a ``date`` trigger at now) runs once, right away, also when it was added before
``start()``. Where the ledger must differ (a slot another replica ran is not run here;
process pools cannot run the ledger's stand-in), the test says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MISSED,
    JobExecutionEvent,
)
from apscheduler.executors.pool import ProcessPoolExecutor
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.schedulers.background import BackgroundScheduler

from pgleaderlock import ConfigurationError, LeaderLock, ThreadedLeaderLock
from pgleaderlock.integrations.apscheduler import bind_scheduler
from support.fixture_types import MakeLock
from support.poll import eventually, eventually_sync
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST_PG = timings(retry_s=0.05, health_interval_s=0.2)
OUTCOMES = EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MISSED
SETTLE_S = 0.3  # after the awaited events: time for a wrong extra run or event to show
CODE = {EVENT_JOB_EXECUTED: "executed", EVENT_JOB_ERROR: "error", EVENT_JOB_MISSED: "missed"}

# (flavour, lead_first): plain APScheduler; bound, the scheduler starts before the lock
# leads (the guide's order); bound, the lock leads before the scheduler starts.
FLAVOURS = [("plain", False), ("bound", False), ("bound", True)]
FLAVOUR_IDS = ["plain", "bound-start-first", "bound-lead-first"]


def outcomes(sched: BackgroundScheduler) -> list[tuple[str, str]]:
    """The (outcome, job id) of every run time, as listeners hear them."""
    heard: list[tuple[str, str]] = []

    def listener(event: JobExecutionEvent) -> None:
        heard.append((CODE[event.code], event.job_id))

    sched.add_listener(listener, OUTCOMES)
    return heard


@contextlib.contextmanager
def running(
    sched: BackgroundScheduler, flavour: str, pg_dsn: str, lock_name: str, lead_first: bool
) -> Iterator[None]:
    """``sched`` started, plain or bound (and leading), until the block ends."""
    if flavour == "plain":
        sched.start()
        try:
            yield
        finally:
            sched.shutdown(wait=True)
        return
    lock = ThreadedLeaderLock(
        LeaderLock.from_name(lock_name, **lock_args(FAST_PG, dsn=pg_dsn, fencing=True))
    )
    bind_scheduler(sched, lock)
    with lock:
        if lead_first:
            assert lock.wait_for_leadership(20)
        sched.start()
        try:
            assert lock.wait_for_leadership(20)
            yield
        finally:
            sched.shutdown(wait=True)


def ledger(pg_dsn: str, lock_name: str, job: str) -> list[str]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT outcome FROM public.pgleaderlock_runs WHERE schedule = %s ORDER BY slot",
            (f"{lock_name}:{job}",),
        ).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize(("flavour", "lead_first"), FLAVOURS, ids=FLAVOUR_IDS)
def test_a_run_time_past_its_misfire_grace_time_is_reported_missed(
    pg_dsn: str, lock_name: str, flavour: str, lead_first: bool
) -> None:
    """User guide, "Missed job executions and coalescing": a run time later than the
    job's ``misfire_grace_time`` is not run, and ``EVENT_JOB_MISSED`` is sent (not
    ``EVENT_JOB_EXECUTED``). Here: a ``date`` job 5 s past, with a grace of 1 s."""
    sched = BackgroundScheduler()
    heard = outcomes(sched)
    ran: list[str] = []
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)
    sched.add_job(ran.append, "date", run_date=past, args=["late"], misfire_grace_time=1,
                  id="late")  # fmt: skip
    with running(sched, flavour, pg_dsn, lock_name, lead_first):
        eventually_sync(lambda: heard, 20.0, "an outcome of the late run")
        time.sleep(SETTLE_S)
        assert sched.get_job("late") is None  # its only run time is over
    assert ran == []
    assert heard == [("missed", "late")]
    if flavour == "bound":
        assert ledger(pg_dsn, lock_name, "late") == ["missed"]  # for the whole fleet


GRACES: list[dict[str, Any]] = [{}, {"misfire_grace_time": 60}, {"misfire_grace_time": None}]


@pytest.mark.parametrize("grace", GRACES, ids=["default-grace", "grace-60", "grace-none"])
@pytest.mark.parametrize(("flavour", "lead_first"), FLAVOURS, ids=FLAVOUR_IDS)
def test_a_run_once_job_added_before_start_runs_once(
    pg_dsn: str, lock_name: str, flavour: str, lead_first: bool, grace: dict[str, Any]
) -> None:
    """User guide, "Adding jobs": a job added with no trigger runs once, immediately
    (a ``date`` trigger at now), also when it is added before the scheduler starts."""
    sched = BackgroundScheduler()
    heard = outcomes(sched)
    ran: list[str] = []
    sched.add_job(ran.append, args=["warm-up"], id="warmup", **grace)
    now = dt.datetime.now(dt.UTC)
    sched.add_job(ran.append, "date", run_date=now, args=["now"], id="at_now", **grace)
    with running(sched, flavour, pg_dsn, lock_name, lead_first):
        eventually_sync(lambda: len(heard) >= 2, 20.0, "both run-once jobs")
        time.sleep(SETTLE_S)
        assert sched.get_jobs() == []
    assert sorted(ran) == ["now", "warm-up"]
    assert sorted(heard) == [("executed", "at_now"), ("executed", "warmup")]
    if flavour == "bound":
        assert ledger(pg_dsn, lock_name, "warmup") == ["done"]


@pytest.mark.parametrize("lead_first", [False, True], ids=["start-first", "lead-first"])
def test_a_slot_another_replica_ran_is_neither_run_nor_reported_here(
    pg_dsn: str, lock_name: str, lead_first: bool
) -> None:
    """Where the ledger differs: a ``date`` job at the same run date on two replicas
    runs once across the fleet. The first replica runs it (``EVENT_JOB_EXECUTED``); the
    second, leading later, finds its slot claimed: it runs nothing, and its listeners
    hear nothing of it (not ``EVENT_JOB_EXECUTED`` with ``retval=None``)."""
    run_date = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.3)
    ran: list[str] = []
    heard: dict[str, list[tuple[str, str]]] = {}
    for replica in ("first", "second"):
        sched = BackgroundScheduler()
        heard[replica] = outcomes(sched)
        sched.add_job(ran.append, "date", run_date=run_date, args=[replica],
                      misfire_grace_time=None, id="once")  # fmt: skip
        with running(sched, "bound", pg_dsn, lock_name, lead_first):
            if replica == "first":
                eventually_sync(lambda: heard["first"], 20.0, "the first replica's run")
            else:
                gone = functools.partial(lambda s: s.get_job("once") is None, sched)
                eventually_sync(gone, 20.0, "the job's end")
                time.sleep(SETTLE_S)
    assert ran == ["first"]
    assert heard == {"first": [("executed", "once")], "second": []}
    assert ledger(pg_dsn, lock_name, "once") == ["done"]


async def test_a_process_pool_is_refused_at_bind(make_lock: MakeLock) -> None:
    """Where the ledger differs: a process pool would have to pickle the stand-in that
    claims each run (it cannot: the job never ran, silently). ``bind_scheduler`` refuses
    it, naming what to use instead; so does the bound scheduler's ``add_executor``."""
    lock = make_lock(fencing=True)
    pool = ProcessPoolExecutor(1)
    try:
        sched = BackgroundScheduler(executors={"cpu": pool})
        with pytest.raises(ConfigurationError, match=r"ProcessPoolExecutor.*ThreadPoolExecutor"):
            bind_scheduler(sched, lock)
        assert not bind_scheduler(sched, lock, ledger=False).ledger  # no stand-in: allowed

        bound = BackgroundScheduler()
        bind_scheduler(bound, lock)
        with pytest.raises(ConfigurationError, match=r"ledger=False"):
            bound.add_executor(pool, "cpu")
        with pytest.raises(ConfigurationError, match=r"ProcessPoolExecutor"):
            bound.add_executor("processpool", "cpu")
        bound.add_executor("threadpool", "io")  # the supported ones still go in
        assert "io" in bound._executors
        assert "cpu" not in bound._executors
    finally:
        pool.shutdown(wait=True)


@pytest.mark.parametrize("flavour", ["plain", "bound"])
async def test_a_coroutine_run_time_past_its_grace_is_reported_missed(
    pg_dsn: str, lock_name: str, flavour: str
) -> None:
    """The same for a coroutine job of an ``AsyncIOScheduler`` (a ``LeaderLock`` on its
    loop), and a run-once coroutine job that runs once beside it."""
    sched = AsyncIOScheduler()
    heard: list[tuple[str, str]] = []
    sched.add_listener(lambda e: heard.append((CODE[e.code], e.job_id)), OUTCOMES)
    ran: list[str] = []

    async def job(name: str) -> None:
        ran.append(name)

    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)
    sched.add_job(job, "date", run_date=past, args=["late"], misfire_grace_time=1, id="late")
    sched.add_job(job, args=["warm-up"], id="warmup")
    lock = LeaderLock.from_name(lock_name, **lock_args(FAST_PG, dsn=pg_dsn, fencing=True))
    if flavour == "bound":
        bind_scheduler(sched, lock)
    sched.start()
    try:
        async with lock:
            await eventually(lambda: len(heard) >= 2, 20.0)
            await asyncio.sleep(SETTLE_S)
    finally:
        sched.shutdown(wait=False)
        await asyncio.sleep(0.01)
    assert ran == ["warm-up"]
    assert sorted(heard) == [("executed", "warmup"), ("missed", "late")]
