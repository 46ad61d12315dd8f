"""LeaderTasks on the in-memory FakeServer: tasks run only while LEADER, stop at once
when the lock leaves LEADER (before an unlock), restart on re-acquisition and after
crashes, and never outlive the lock."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import (
    ConfigurationError,
    FixedInterval,
    LeaderLock,
    LeaderTasks,
    LockState,
    RetryContext,
)
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorder
from support.flaky import Flaky
from support.poll import eventually

if TYPE_CHECKING:
    pass

S = LockState
pytestmark = pytest.mark.timeout(30)


class Probe:
    """A leader task that records its runs and checks, on every step, that its lock is
    LEADER; at its end it records whether the lock was still held on the server."""

    def __init__(self, lock: LeaderLock, server: FakeServer | None = None) -> None:
        self.lock = lock
        self.server = server
        self.starts = 0
        self.stops = 0
        self.violations: list[LockState] = []
        self.held_at_stop: list[bool] = []

    async def run(self) -> None:
        self.starts += 1
        try:
            while True:
                if self.lock.state is not S.LEADER:
                    self.violations.append(self.lock.state)
                await asyncio.sleep(0.002)
        finally:
            self.stops += 1
            if self.server is not None:
                holder = self.server.holder(*self.lock.keys)
                self.held_at_stop.append(
                    holder is not None and holder.backend_pid == self.lock.backend_pid
                )


async def test_runs_while_leader_stops_before_unlock_and_restarts(
    make_lock: MakeLock, server: FakeServer
) -> None:
    lock = make_lock()
    tasks = LeaderTasks(lock)
    probe = Probe(lock, server)
    tasks.add(probe.run, name="probe")
    assert tasks.running == []
    await lock.start()
    await eventually(lambda: probe.starts == 1)
    assert tasks.running == ["probe"]

    await lock.step_down()
    assert probe.stops == 1
    assert probe.held_at_stop == [True], "the task must have ended before the unlock"
    assert tasks.running == []

    await eventually(lambda: probe.starts == 2)  # no competitor: the lock comes back
    await lock.shutdown()
    assert probe.stops == 2
    assert probe.held_at_stop == [True, True]
    assert probe.violations == []
    await tasks.stop()


async def test_tasks_stop_before_callbacks_registered_earlier_run(
    make_lock: MakeLock,
) -> None:
    lock = make_lock()
    probe = Probe(lock)
    seen_by_callback: list[int] = []

    @lock.on_state_change
    def before_tasks(old: LockState, new: LockState) -> None:
        if old is S.LEADER:
            seen_by_callback.append(probe.stops)

    tasks = LeaderTasks(lock)  # registered after the callback, runs before it
    tasks.add(probe.run)
    await lock.start()
    await eventually(lambda: probe.starts == 1)
    await lock.step_down()
    assert seen_by_callback == [1]
    await tasks.close()
    await eventually(lambda: lock.is_leader)
    await asyncio.sleep(0.05)  # kept: a window for a wrong start to show
    assert probe.starts == 1  # closed: never started again


@pytest.mark.parametrize("how", ["step_down", "loss"])
async def test_every_leader_task_of_a_lock_is_cancelled_at_once(
    how: str, make_lock: MakeLock, server: FakeServer
) -> None:
    """Two ``LeaderTasks`` on one lock; the first one's task takes its time to clean up
    once cancelled. When the lock leaves LEADER (a step-down, a terminated session) the
    second one's task is cancelled at the same moment, not after the first one's
    cleanup (the listeners await their tasks one after the other): it never runs while
    the lock is not LEADER."""
    lock = make_lock()
    first, second = LeaderTasks(lock), LeaderTasks(lock)
    events: list[str] = []
    violations: list[LockState] = []

    @first.task
    async def slow() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append("slow cancelled")
            await asyncio.sleep(0.5)  # a graceful cleanup
            events.append("slow cleaned up")
            raise

    @second.task
    async def quick() -> None:
        try:
            while True:
                if lock.state is not S.LEADER:
                    violations.append(lock.state)
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            events.append("quick cancelled")
            raise

    await lock.start()
    await eventually(lambda: first.running == ["slow"] and second.running == ["quick"])
    if how == "step_down":
        await lock.step_down()
    else:
        server.terminate()  # the holder's session
        await eventually(lambda: "slow cleaned up" in events)
    assert events.index("quick cancelled") < events.index("slow cleaned up"), events
    assert violations == []


async def test_loss_stops_task_at_reconnecting_and_reacquire_restarts_it(
    make_lock: MakeLock,
    server: FakeServer,
    recorder: MakeRecorder,
) -> None:
    lock = make_lock(reconnect_grace_s=10)
    rec = recorder(lock)
    tasks = LeaderTasks(lock)
    probe = Probe(lock)
    tasks.add(probe.run)
    await lock.start()
    await eventually(lambda: probe.starts == 1)

    server.terminate()  # like pg_terminate_backend on the leader's session
    await eventually(lambda: probe.starts == 2)
    assert probe.stops == 1
    assert S.RECONNECTING in rec.states()
    assert "lost" not in rec.names()  # flap damping: leadership recovered silently
    assert probe.violations == []
    await lock.shutdown()
    await tasks.stop()


async def test_failover_between_two_locks(make_lock: MakeLock, server: FakeServer) -> None:
    a, b = make_lock(), make_lock()
    probes = {}
    for lock in (a, b):
        probes[lock] = Probe(lock)
        LeaderTasks(lock).add(probes[lock].run, name="work")
    await a.start()
    await eventually(lambda: probes[a].starts == 1)
    await b.start()
    await asyncio.sleep(0.1)  # kept: a window for a wrong start to show
    assert probes[b].starts == 0, "a follower ran a leader task"

    server.terminate()
    await eventually(lambda: probes[b].starts == 1 and probes[a].stops == 1)
    await asyncio.sleep(0.1)  # kept: a window for a wrong start to show
    assert b.is_leader
    assert probes[a].starts == 1  # a is a follower now
    assert probes[a].violations == probes[b].violations == []


async def test_crash_is_restarted_and_leadership_untouched(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = make_lock()
    rec = recorder(lock)
    tasks = LeaderTasks(lock, retry_strategy=FixedInterval(0.01))
    flaky = Flaky(3, "boom")
    tasks.add(flaky.run, name="flaky")
    await lock.start()
    async with asyncio.timeout(10):
        await flaky.running.wait()
    assert flaky.calls == 4
    assert lock.is_leader
    assert rec.names() == ["acquired"]
    crashes = [r for r in caplog.records if r.getMessage().startswith("leader_task_crashed")]
    assert len(crashes) == 3
    assert "attempt=3" in crashes[-1].getMessage()
    assert crashes[0].exc_info is not None


async def test_retry_strategy_none_gives_the_task_up(
    make_lock: MakeLock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgleaderlock")

    class Never:
        def next_delay_s(self, ctx: RetryContext) -> float | None:
            assert isinstance(ctx.last_error, ValueError)
            return None

    lock = make_lock()
    tasks = LeaderTasks(lock, retry_strategy=Never())
    calls = 0

    async def broken() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("no")

    tasks.add(broken)
    await lock.start()
    await eventually(lambda: any("leader_task_gave_up" in r.getMessage() for r in caplog.records))
    await asyncio.sleep(0.05)  # kept: a window for a wrong retry to show
    assert calls == 1
    assert lock.is_leader
    assert tasks.running == []


async def test_finished_task_runs_once_per_term(make_lock: MakeLock) -> None:
    lock = make_lock()
    tasks = LeaderTasks(lock)
    runs = 0

    @tasks.task
    async def once() -> None:
        nonlocal runs
        runs += 1

    await lock.start()
    await eventually(lambda: runs == 1)
    await asyncio.sleep(0.1)  # kept: a window for a wrong second run to show
    assert runs == 1
    await lock.step_down()
    await eventually(lambda: runs == 2)


async def test_task_that_ignores_cancel_is_bounded_and_not_duplicated(
    make_lock: MakeLock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = make_lock()
    tasks = LeaderTasks(lock, cancel_timeout_s=0.2)
    release = asyncio.Event()
    starts = 0

    @tasks.task(name="stubborn")
    async def stubborn() -> None:
        nonlocal starts
        starts += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # ignores the cancellation until released
            raise

    await lock.start()
    await eventually(lambda: starts == 1)
    await lock.step_down()  # returns after the bounded wait
    assert any("leader_task_ignores_cancel" in r.getMessage() for r in caplog.records)
    assert await lock.wait_for_leadership(5)
    await eventually(
        lambda: any("leader_task_not_started" in r.getMessage() for r in caplog.records)
    )
    assert starts == 1, "a second copy started while the first was still running"

    release.set()
    await eventually(lambda: tasks.running == [], 5, "the first copy ended")
    await lock.step_down()
    await eventually(lambda: starts == 2)
    await lock.shutdown()
    release.set()
    await tasks.stop()
    assert tasks.running == []


async def test_lock_task_ending_abnormally_cancels_the_tasks(
    make_lock: MakeLock,
) -> None:
    lock = make_lock()
    tasks = LeaderTasks(lock)
    probe = Probe(lock)
    tasks.add(probe.run)
    await lock.start()
    await eventually(lambda: probe.starts == 1)
    assert lock._runner.task is not None
    lock._runner.task.cancel()  # what shutdown(timeout_s) does when the task is stuck
    await eventually(lambda: probe.stops == 1)
    await tasks.stop()
    assert tasks.running == []


async def test_add_while_leading_starts_at_once(make_lock: MakeLock) -> None:
    lock = make_lock()
    tasks = LeaderTasks(lock)
    await lock.start()
    assert await lock.wait_for_leadership(5)
    probe = Probe(lock)
    tasks.add(probe.run)
    await eventually(lambda: probe.starts == 1)
    await lock.shutdown()
    assert probe.stops == 1


async def test_registration_is_checked(make_lock: MakeLock) -> None:
    lock = make_lock()
    tasks = LeaderTasks(lock)

    def not_async() -> None:
        pass

    with pytest.raises(ConfigurationError, match="coroutine function"):
        tasks.add(not_async)  # type: ignore[arg-type]

    async def job() -> None:
        pass

    tasks.add(job)
    with pytest.raises(ConfigurationError, match="already registered"):
        tasks.add(job)
    tasks.add(job, name="job-2")
    assert tasks.names == ["job", "job-2"]
    with pytest.raises(ConfigurationError):
        LeaderTasks(lock, cancel_timeout_s=0)
    with pytest.raises(ConfigurationError):
        LeaderTasks(object())  # type: ignore[arg-type]
