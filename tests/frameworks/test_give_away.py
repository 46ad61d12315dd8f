"""``give_away_after_crashes`` for leader tasks (``LeaderTasks``, ``LeaderLifespan``) on
the in-memory FakeServer: after N crashes in a row of one task, the replica shuts its
lock down (every task stopped first, then the lock released), a healthy replica takes
over, and the replica competes again only after the cool-down."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from pgleaderlock import ConfigurationError, FixedInterval, LeaderLock, LeaderTasks, LockState
from pgleaderlock.integrations.fastapi import LeaderLifespan
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock
from support.poll import eventually

S = LockState
pytestmark = pytest.mark.timeout(30)


def messages(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(event)]


async def test_crashes_in_a_row_give_the_lock_to_a_healthy_replica(
    make_lock: MakeLock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    sick, healthy = make_lock(name="give"), make_lock(name="give")
    crashes = 0
    steady: dict[str, int] = {"sick": 0, "healthy": 0}
    overlap: list[str] = []

    def tasks_of(lock: LeaderLock, label: str, *, crash: bool) -> LeaderTasks:
        tasks = LeaderTasks(
            lock,
            retry_strategy=FixedInterval(0.01),
            give_away_after_crashes=3,
            give_away_cooldown_s=0.5,
        )

        @tasks.task(name="work")
        async def work() -> None:
            nonlocal crashes
            if crash:
                crashes += 1
                raise RuntimeError("local disk is broken")
            if sick.is_leader:
                overlap.append(label)
            steady[label] += 1
            await asyncio.Event().wait()

        @tasks.task(name="other")
        async def other() -> None:  # a healthy task of the sick replica: moves too
            await asyncio.Event().wait()

        return tasks

    sick_tasks = tasks_of(sick, "sick", crash=True)
    healthy_tasks = tasks_of(healthy, "healthy", crash=False)
    await sick.start()
    assert await sick.wait_for_leadership(5)
    await healthy.start()

    await eventually(lambda: healthy.is_leader)
    assert crashes == 3, "exactly give_away_after_crashes crashes, then the lock went"
    assert sick.state is S.STOPPED
    assert sick_tasks.running == []
    paused = sick_tasks.paused_until
    assert paused is not None
    assert time.time() < paused <= time.time() + 0.5
    await eventually(lambda: steady["healthy"] == 1)
    assert healthy_tasks.running == ["work", "other"]
    assert overlap == []
    [given] = messages(caplog, "leadership_given_away")
    assert "task=work" in given
    assert "crashes=3" in given
    assert len(messages(caplog, "leader_task_gave_up")) == 1

    # After the cool-down the sick replica competes again: a follower of the healthy one.
    await eventually(lambda: sick.state in (S.FOLLOWER, S.ACQUIRING))
    assert sick_tasks.paused_until is None
    assert len(messages(caplog, "leadership_competing_again")) == 1
    assert healthy.is_leader

    await healthy.shutdown()  # the sick replica takes over, crashes 3 times, gives away
    await eventually(lambda: crashes == 6 and sick.state is S.STOPPED)
    assert len(messages(caplog, "leadership_given_away")) == 2
    await sick_tasks.stop()  # ends the cool-down: the lock stays stopped
    assert sick_tasks.paused_until is None
    await asyncio.sleep(0.7)  # kept: longer than the cool-down, for a wrong restart to show
    assert sick.state is S.STOPPED
    await healthy_tasks.stop()


async def test_a_crash_streak_broken_by_a_success_does_not_give_away(
    make_lock: MakeLock,
) -> None:
    """Crashes count in a row within one run of the task; a run that returns normally
    (finished for this term) ends the streak, and the lock is kept."""
    lock = make_lock()
    tasks = LeaderTasks(lock, retry_strategy=FixedInterval(0.01), give_away_after_crashes=2)
    runs = 0

    @tasks.task
    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("once")
        # then finishes normally for this term

    await lock.start()
    await eventually(lambda: runs == 2)
    await asyncio.sleep(0.1)  # kept: a window for a wrong give-away to show
    assert lock.is_leader
    assert tasks.paused_until is None
    await lock.shutdown()
    await tasks.stop()


async def test_without_the_option_a_crashing_task_never_moves_the_lock(
    make_lock: MakeLock,
) -> None:
    lock = make_lock()
    tasks = LeaderTasks(lock, retry_strategy=FixedInterval(0.001))
    crashes = 0

    @tasks.task
    async def broken() -> None:
        nonlocal crashes
        crashes += 1
        raise RuntimeError("always")

    await lock.start()
    await eventually(lambda: crashes >= 50)
    assert lock.is_leader
    assert tasks.paused_until is None
    await lock.shutdown()
    await tasks.stop()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"give_away_after_crashes": 0}, "give_away_after_crashes must be a positive int"),
        ({"give_away_after_crashes": True}, "give_away_after_crashes must be a positive int"),
        ({"give_away_after_crashes": 1.5}, "give_away_after_crashes must be a positive int"),
        ({"give_away_cooldown_s": 0}, "give_away_cooldown_s must be a positive, finite number"),
        ({"give_away_cooldown_s": "60"}, "give_away_cooldown_s must be a number"),
    ],
)
def test_bad_give_away_arguments(
    make_lock: MakeLock, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        LeaderTasks(make_lock(), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=message):
        LeaderLifespan(make_lock(), **kwargs)  # type: ignore[arg-type]


async def test_lifespan_status_during_the_cool_down(
    make_lock: MakeLock, server: FakeServer
) -> None:
    """The replica that gave its leadership away is not leader, its lock is stopped,
    and it says until when; it stays ready (it competes again after the cool-down), so
    a readiness probe does not take it out of service."""
    sick, healthy = make_lock(name="lifespan-give"), make_lock(name="lifespan-give")
    leaders = {
        sick: LeaderLifespan(sick, give_away_after_crashes=2, give_away_cooldown_s=30),
        healthy: LeaderLifespan(healthy, give_away_after_crashes=2, give_away_cooldown_s=30),
    }

    @leaders[sick].task(name="work")
    async def crashing() -> None:
        raise RuntimeError("broken here")

    @leaders[healthy].task(name="work")
    async def working() -> None:
        await asyncio.Event().wait()

    apps = {lock: FastAPI(lifespan=leader) for lock, leader in leaders.items()}
    for lock, app in apps.items():
        app.include_router(leaders[lock].router())
    async with (
        LifespanManager(apps[sick]) as ms,
        LifespanManager(apps[healthy]) as mh,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=ms.app), base_url="http://s") as http,
    ):
        assert mh.app is not None
        await eventually(lambda: healthy.is_leader and sick.state is S.STOPPED, 20)
        status = (await http.get("/leader")).json()
        assert status["state"] == "stopped"
        assert status["is_leader"] is False
        assert status["ready"] is True
        assert status["paused_until"] is not None
        assert (await http.get("/leader/ready")).status_code == 200
        assert leaders[healthy].tasks.running == ["work"]
    # The app's shutdown ends the cool-down: nothing restarts the lock afterwards.
    assert leaders[sick].tasks.paused_until is None
    assert sick.state is S.STOPPED
    assert leaders[sick].status().ready is False
    assert server.open_sessions == []
