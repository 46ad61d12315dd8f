"""The schedule's policies, on one backend (they are the same SQL on every one; the
driver-specific parts, statements and ``run.transaction``, are in
``tests/contract/test_schedule_contract.py``): replicas that step down, slots nobody ran
(catch-up), slots whose leader ended mid-run (interrupted)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import time
from typing import Any

import pytest

from pgleaderlock import LeaderLock, LockState
from pgleaderlock.schedule import Policy, Run, Scheduler
from support.poll import eventually
from support.schedule import ledger, sched_every
from support.server import Admin
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST: dict[str, Any] = timings(retry_s=0.02, health_interval_s=0.1, load_plugins=False)


class Target:
    """Locks on the test server (the contract suite's ``target.lock``, for one backend)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def lock(self, keys: tuple[int, int], **kwargs: Any) -> LeaderLock:
        return LeaderLock(self.dsn, *keys, **lock_args({**FAST, **kwargs}))


@pytest.fixture
def target(pg_dsn: str) -> Target:
    return Target(pg_dsn)


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
            await eventually(lambda: any(lk.is_leader for lk, _ in replicas))
            wanted = len(runs) + 2
            await eventually(lambda: len(runs) >= wanted, 10)  # noqa: B023 - awaited here
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

        sched.add(job, sched_every(1.0), name=name,
                  policy=Policy(catch_up=policy, misfire_grace_s=0.4))  # type: ignore[arg-type]  # fmt: skip
        return lock, sched

    lock, sched = replica()
    async with lock, sched:
        await eventually(lambda: len(ran) >= 1)
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
        await eventually(lambda: any(slot > takeover for slot in ran))
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

        sched.add(job, hourly, name="slow", policy=Policy(interrupted=interrupted,  # type: ignore[arg-type]
                  catch_up="latest", misfire_grace_s=3600))  # fmt: skip
        return lock, sched

    first, first_sched = replica()
    async with first, first_sched:
        await eventually(lambda: len(started) == 1)
        await admin.execute("SELECT pg_terminate_backend(%s)", (first.backend_pid,))
        await eventually(lambda: not first.is_leader)
    assert first.state is LockState.STOPPED
    second, second_sched = replica()
    async with second, second_sched:
        await eventually(lambda: second.is_leader and second.term != started[0].term)
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


@pytest.mark.parametrize("after_a_run", [False, True])
async def test_a_graceful_stop_does_not_wait_for_the_next_slot(
    target: Target, keys: tuple[int, int], after_a_run: bool
) -> None:
    """With ``drain_s``, a graceful stop lets a run in progress finish; a schedule that
    waits for its next slot (an hour away) ends at once instead of holding the lock
    until ``drain_s`` is over. (``after_a_run``: the loop is asleep until the next slot
    when the stop comes; it waited all of ``drain_s`` before issue 32's fix.)"""
    lock = target.lock(keys, fencing=True, drain_s=30.0)
    sched = Scheduler(lock)
    ran: list[Run] = []

    async def hourly(run: Run) -> None:
        ran.append(run)

    sched.add(hourly, sched_every(3600, first_in_s=0.3 if after_a_run else None), name="hourly")
    async with sched:
        await lock.start()
        assert await lock.wait_for_leadership(10)
        await eventually(lambda: "hourly" in sched._tasks.running)
        if after_a_run:
            await eventually(lambda: len(ran) == 1)
            await asyncio.sleep(0.3)  # the loop sleeps until the next slot
        started = time.monotonic()
        await lock.shutdown()
        took = time.monotonic() - started
    assert took < 10.0, f"the stop waited {took:.1f} s for a slot an hour away"
    assert len(ran) == after_a_run
