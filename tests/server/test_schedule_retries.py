"""Failed runs retried (issue 32): a slot whose job raised is tried again, as a new
attempt of the same slot under the current term, after a back-off that does not hold up
the job's later slots, up to the policy's ``max_attempts``; the next leader takes over
a retry due when leadership moves; ``status`` shows the attempts. (Every test here
fails on the code before ``Retry``: a failed slot was never run again.)"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import psycopg
import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.schedule import Policy, Retry, Run, Scheduler
from pgleaderlock.status import schedule_report
from pgleaderlock.status.render import schedule_lines
from support.poll import eventually
from support.schedule import ledger, sched_every
from support.server import Admin
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST: dict[str, Any] = timings(retry_s=0.02, health_interval_s=0.1, load_plugins=False)


def fenced(dsn: str, keys: tuple[int, int], **kwargs: Any) -> LeaderLock:
    return LeaderLock(dsn, *keys, **lock_args({**FAST, "fencing": True, **kwargs}))


class Attempts:
    """A job that raises ``errors`` in turn, then returns; it notes each attempt."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.seen: list[tuple[dt.datetime, int, int, float]] = []  # slot, attempt, term, at

    async def run(self, run: Run) -> None:
        self.seen.append((run.slot, run.attempt, run.term, time.monotonic()))
        if len(self.seen) <= len(self.errors):
            raise self.errors[len(self.seen) - 1]


async def test_a_job_that_raises_twice_then_succeeds_is_done_at_its_third_attempt(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    job = Attempts(ConnectionError("the primary went away"), ConnectionError("still away"))
    lock = fenced(pg_dsn, keys)
    sched = Scheduler(lock)
    retry = Retry(max_attempts=3, backoff_s=0.3, on=(ConnectionError,))
    sched.add(job.run, sched_every(3600, first_in_s=0.5), name="sync", policy=Policy(retry=retry))
    async with lock, sched:
        await eventually(lambda: len(job.seen) == 3, 10)
        name = sched.schedule_name("sync")
        await eventually(lambda: _outcome(admin, name, "done"), 5)
    rows = await ledger(admin, name)
    assert len(rows) == 1
    slot, term, outcome, attempt, _, _, detail = rows[0]
    assert (outcome, attempt, detail) == ("done", 3, None)
    assert [(s, a, t) for s, a, t, _ in job.seen] == [
        (slot, 1, term),
        (slot, 2, term),
        (slot, 3, term),
    ]
    times = [at for *_, at in job.seen]
    assert times[1] - times[0] >= 0.3 - 0.05  # the back-off doubles: 0.3 s, then 0.6 s
    assert times[2] - times[1] >= 0.6 - 0.05


@pytest.mark.parametrize(
    ("error", "attempts"),
    [(ConnectionError("down"), 3), (ValueError("a bug"), 1)],
    ids=["retried-until-the-last-attempt", "an-error-not-retried"],
)
async def test_a_job_that_keeps_raising_ends_failed_with_its_error(
    pg_dsn: str, keys: tuple[int, int], admin: Admin, error: Exception, attempts: int
) -> None:
    job = Attempts(*[error] * 5)
    lock = fenced(pg_dsn, keys)
    sched = Scheduler(lock)
    retry = Retry(max_attempts=3, backoff_s=0.05, on=(ConnectionError,))
    sched.add(job.run, sched_every(3600, first_in_s=0.5), name="sync", policy=Policy(retry=retry))
    name = sched.schedule_name("sync")
    async with lock, sched:
        await eventually(lambda: len(job.seen) == attempts, 10)
        await eventually(lambda: _final(admin, name), 5)
        await asyncio.sleep(0.5)  # no further attempt comes
    rows = await ledger(admin, name)
    assert [(row[2], row[3], row[6]) for row in rows] == [
        ("failed", attempts, f"{type(error).__name__}: {error}")
    ]
    assert [a for _, a, _, _ in job.seen] == list(range(1, attempts + 1))


async def test_the_back_off_lets_the_next_slots_run_first(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    """Every second; the first slot fails and its retry is due 2.5 s later: the two
    slots in between run on time, then the retry (runs of one job never overlap)."""
    job = Attempts(ConnectionError("the primary went away"))
    lock = fenced(pg_dsn, keys)
    sched = Scheduler(lock)
    retry = Retry(max_attempts=2, backoff_s=2.5)
    sched.add(job.run, sched_every(1, first_in_s=0.5), name="tick", policy=Policy(retry=retry))
    async with lock, sched:
        await eventually(lambda: any(a == 2 for _, a, _, _ in job.seen), 10)
    first = job.seen[0][0]
    order = [(s, a) for s, a, _, _ in job.seen]
    retried = order.index((first, 2))
    assert order[0] == (first, 1)
    between = [s for s, a in order[1:retried]]
    assert len(between) >= 2  # on time, not held up
    assert all(s > first for s in between)
    assert job.seen[retried][3] - job.seen[0][3] >= 2.5 - 0.05
    rows = {row[0]: row for row in await ledger(admin, sched.schedule_name("tick"))}
    assert (rows[first][2], rows[first][3]) == ("done", 2)
    assert all((rows[s][2], rows[s][3]) == ("done", 1) for s in between)


async def test_a_retry_due_when_leadership_moves_runs_under_the_next_leaders_term(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    """The leader's attempt fails and it steps down during the back-off: the row says
    ``failed``, retry pending (and ``status`` says so); the other replica, leading under
    a newer term, runs the retry after its back-off. Never two runs of one attempt."""
    job = Attempts(ConnectionError("the primary went away"))
    retry = Retry(max_attempts=3, backoff_s=1.0)
    hourly = sched_every(3600, first_in_s=0.5)  # one spec for both replicas

    def replica() -> tuple[LeaderLock, Scheduler]:
        lock = fenced(pg_dsn, keys, auto_reacquire=False)
        sched = Scheduler(lock)
        sched.add(job.run, hourly, name="sync", policy=Policy(retry=retry))
        return lock, sched

    first, first_sched = replica()
    name = first_sched.schedule_name("sync")
    async with first, first_sched:
        await eventually(lambda: _outcome(admin, name, "failed"), 10)
        lines = await _status(pg_dsn, first_sched)
        assert any("failed (attempt 1, retry pending)" in line for line in lines), lines
        await first.step_down()
    assert len(job.seen) == 1
    second, second_sched = replica()
    async with second, second_sched:
        await eventually(lambda: second.is_leader)
        began = time.monotonic()
        await eventually(lambda: _outcome(admin, name, "done"), 10)
        assert time.monotonic() - began >= 1.0 - 0.05  # its back-off, from when it leads
        assert second.term is not None
        new_term = second.term
    rows = await ledger(admin, name)
    (slot, term, outcome, attempt, *_) = rows[0]
    assert len(rows) == 1
    assert (outcome, attempt, term) == ("done", 2, new_term)
    assert [(s, a) for s, a, _, _ in job.seen] == [(slot, 1), (slot, 2)]
    assert job.seen[0][2] < job.seen[1][2] == new_term
    lines = await _status(pg_dsn, second_sched)
    assert any("done" in line and "(attempt 2)" in line for line in lines), lines


async def test_a_retry_due_is_given_up_by_a_leader_whose_policy_allows_no_more(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    """The next leader runs an older release's policy (one attempt): the failure the
    first one meant to retry is recorded final, not left pending."""
    job = Attempts(ConnectionError("the primary went away"))
    lock = fenced(pg_dsn, keys, auto_reacquire=False)
    sched = Scheduler(lock)
    policy = Policy(retry=Retry(max_attempts=3, backoff_s=30.0))
    hourly = sched_every(3600, first_in_s=0.5)
    sched.add(job.run, hourly, name="sync", policy=policy)
    name = sched.schedule_name("sync")
    async with lock, sched:
        await eventually(lambda: _outcome(admin, name, "failed"), 10)
        await lock.step_down()
    lock = fenced(pg_dsn, keys)
    sched = Scheduler(lock)
    sched.add(job.run, hourly, name="sync")
    async with lock, sched:
        await eventually(lambda: _final(admin, name), 10)
    assert len(job.seen) == 1


async def test_a_graceful_stop_does_not_wait_for_a_back_off(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    """With ``drain_s``, a stop during a minute's back-off ends at once; the retry stays
    due in the ledger, for the next leader."""
    job = Attempts(ConnectionError("the primary went away"))
    lock = fenced(pg_dsn, keys, drain_s=30.0)
    sched = Scheduler(lock)
    policy = Policy(retry=Retry(max_attempts=2, backoff_s=60.0))
    sched.add(job.run, sched_every(3600, first_in_s=0.5), name="sync", policy=policy)
    name = sched.schedule_name("sync")
    async with sched:
        await lock.start()
        await eventually(lambda: _outcome(admin, name, "failed"), 10)
        started = time.monotonic()
        await lock.shutdown()
        took = time.monotonic() - started
    assert took < 10.0, f"the stop waited {took:.1f} s for a back-off of 60 s"
    assert len(job.seen) == 1
    assert not await _final(admin, name)  # failed, its retry still due


async def test_a_slot_whose_transaction_committed_is_not_retried(
    pg_dsn: str, keys: tuple[int, int], admin: Admin
) -> None:
    """Exactly once per slot: a job that raises after its ``run.transaction`` committed
    (the slot is ``done``) is not tried again."""
    seen: list[int] = []

    async def job(run: Run) -> None:
        seen.append(run.attempt)
        async with (
            await psycopg.AsyncConnection.connect(pg_dsn) as conn,
            run.transaction(conn),
        ):
            pass
        raise ConnectionError("after the commit")

    lock = fenced(pg_dsn, keys)
    sched = Scheduler(lock)
    policy = Policy(retry=Retry(max_attempts=3, backoff_s=0.05))
    sched.add(job, sched_every(3600, first_in_s=0.5), name="sync", policy=policy)
    async with lock, sched:
        await eventually(lambda: len(seen) == 1, 10)
        await asyncio.sleep(0.5)
    rows = await ledger(admin, sched.schedule_name("sync"))
    assert [(row[2], row[3]) for row in rows] == [("done", 1)]
    assert seen == [1]


# ------------------------------------------------------------------ helpers


async def _row(admin: Admin, name: str) -> tuple[Any, ...] | None:
    cur = await admin.execute(
        "SELECT outcome, finished_at FROM public.pgleaderlock_runs WHERE schedule = %s", (name,)
    )
    return await cur.fetchone()


async def _outcome(admin: Admin, name: str, outcome: str) -> bool:
    row = await _row(admin, name)
    return row is not None and row[0] == outcome


async def _final(admin: Admin, name: str) -> bool:
    """The slot failed and no retry is due."""
    row = await _row(admin, name)
    return row is not None and row[0] == "failed" and row[1] is not None


async def _status(dsn: str, sched: Scheduler) -> list[str]:
    """``pgleaderlock status``'s lines for the scheduler's schedules."""
    tables = sched.ledger
    with psycopg.connect(dsn) as conn:
        report = schedule_report(conn, tables.runs, tables.schedules, [sched.schedule_name("")])
    return schedule_lines(report, dt.datetime.now(dt.UTC))
