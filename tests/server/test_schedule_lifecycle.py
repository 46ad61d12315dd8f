"""When a Scheduler (and the ``LeaderTasks`` under it) may be made and started: before
the lock starts or while it leads, its jobs run; one never started says so, once."""

from __future__ import annotations

import logging

import pytest

from pgleaderlock import Fencing, LeaderLock, LeaderTasks, LockOptions
from pgleaderlock.schedule import Run, Scheduler
from support.poll import eventually
from support.schedule import sched_every

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

OPTIONS = LockOptions(load_plugins=False, fencing=Fencing(enabled=True))


async def test_a_scheduler_made_while_its_lock_leads_runs_its_jobs(
    pg_dsn: str, keys: tuple[int, int]
) -> None:
    runs: list[Run] = []

    async def job(run: Run) -> None:
        runs.append(run)

    async with LeaderLock(pg_dsn, *keys, options=OPTIONS) as lock:
        assert await lock.wait_for_leadership(10)
        sched = Scheduler(lock)
        sched.add(job, sched_every(1), name="job")
        async with sched:
            await eventually(lambda: len(runs) >= 2, 10)
            assert {run.term for run in runs} == {lock.term}  # this leadership's


async def test_leader_tasks_made_while_the_lock_leads_start_as_they_are_added(
    pg_dsn: str, keys: tuple[int, int]
) -> None:
    started: list[str] = []

    async def work() -> None:
        started.append("work")

    async with LeaderLock(pg_dsn, *keys, options=OPTIONS) as lock:
        assert await lock.wait_for_leadership(10)
        tasks = LeaderTasks(lock)
        tasks.add(work)
        await eventually(lambda: started == ["work"], 5)
        await tasks.close()


async def test_a_scheduler_never_started_says_so_once_when_its_lock_leads(
    pg_dsn: str, keys: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    lock = LeaderLock(pg_dsn, *keys, options=OPTIONS)
    sched = Scheduler(lock)

    @sched.every(seconds=1)
    async def report(run: Run) -> None:
        raise AssertionError("a scheduler never started ran a job")

    caplog.set_level(logging.WARNING, "pgleaderlock.schedule")
    for _ in range(2):  # two leaderships, one warning
        async with lock:
            assert await lock.wait_for_leadership(10)
    warned = [r for r in caplog.records if "scheduler_not_started" in r.getMessage()]
    assert len(warned) == 1
    assert "jobs=report" in warned[0].getMessage()
    await sched.shutdown()
