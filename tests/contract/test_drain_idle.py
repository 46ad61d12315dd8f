"""A graceful stop drains only what runs (issue 33), on every backend.

A leader task that sleeps between units of work in ``tasks.idle()`` is not waited for:
a stop with nothing running returns at once, whatever ``drain_s`` is; a unit of work
that runs is waited for (at most ``drain_s``), and its task ends at its next ``idle``.
Before issue 33 a task sleeping between units kept the lock until ``drain_s`` ran out
(the drain could not tell it from one at work): the bounds below are far under
``drain_s``, so these tests fail there.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import LeaderTasks
from pgleaderlock.coordination.workers import CheckpointTable, WorkerContext, Workers
from pgleaderlock.lowlevel import FixedInterval
from support.fixture_types import MakeRecorder

if TYPE_CHECKING:
    from contract.conftest import Target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DRAIN_S = 120.0
"""Far longer than any test: a stop that waited for it would fail the test's bound."""
BOUND_S = 10.0


async def test_a_stop_with_only_idle_tasks_returns_without_waiting_for_drain_s(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    lock = target.lock(keys, drain_s=DRAIN_S)
    tasks = LeaderTasks(lock)
    rec = recorder(lock)
    units: list[str] = []
    ended: list[str] = []

    def task(name: str) -> None:
        async def loop() -> None:
            try:
                while True:
                    units.append(name)
                    await tasks.idle(600)
            except asyncio.CancelledError:
                ended.append(name)
                raise

        tasks.add(loop, name=name)

    task("refresh")
    task("cleanup")
    await lock.start()
    assert await lock.wait_for_leadership(10)
    while sorted(set(units)) != ["cleanup", "refresh"]:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(lock.shutdown(timeout_s=DRAIN_S + 10), BOUND_S)
    assert sorted(ended) == ["cleanup", "refresh"]
    assert units.count("refresh") == 1  # ended in its sleep, no unit started in the drain
    assert rec.names()[-2:] == ["released", "stopped"]
    await tasks.close()


async def test_a_running_unit_is_waited_for_and_its_task_ends_at_its_next_idle(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    lock = target.lock(keys, drain_s=DRAIN_S, retry_strategy=FixedInterval(0.5))
    tasks = LeaderTasks(lock)
    rec = recorder(lock)
    started, release = asyncio.Event(), asyncio.Event()
    done: list[bool] = []  # is_leader as each unit ended

    @tasks.task
    async def work() -> None:
        while True:
            started.set()
            await release.wait()  # one unit of work, as long as the test says
            done.append(lock.is_leader)
            await tasks.idle(600)

    @tasks.task
    async def idle_one() -> None:
        while True:
            await tasks.idle(600)

    await lock.start()
    assert await lock.wait_for_leadership(10)
    await asyncio.wait_for(started.wait(), 5)
    stop = asyncio.ensure_future(lock.shutdown(timeout_s=DRAIN_S + 10))
    while not lock.draining:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # the drain waits for the unit, however long it takes
    assert not stop.done()
    assert lock.is_leader
    assert tasks.running == ["work"]  # the idle one ended at once
    release.set()
    await asyncio.wait_for(stop, BOUND_S)
    assert done == [True]  # the unit finished while still leading, and no other began
    assert rec.names()[-2:] == ["released", "stopped"]
    await tasks.close()


async def test_idle_coordinator_workers_end_at_once_in_a_drain() -> None:
    workers = Workers(FixedInterval(0.5), None, lambda name: None, label="g")
    ran: list[str] = []
    release = asyncio.Event()

    async def worker(context: WorkerContext) -> None:
        while True:
            ran.append(context.name)
            if context.name == "busy":
                await release.wait()
            await context.idle(600)

    for name in ("a", "b", "busy"):
        context = WorkerContext(name, None, "m1", None, CheckpointTable(), "g")
        workers.start(name, worker, context)
    while len(ran) < 3:
        await asyncio.sleep(0.01)
    drain = asyncio.ensure_future(workers.drain(None, DRAIN_S))
    await asyncio.sleep(0.3)
    assert not drain.done()  # "busy" runs a unit
    assert workers.running == frozenset({"busy"})  # the idle ones ended at once
    release.set()
    await asyncio.wait_for(drain, BOUND_S)
    assert workers.running == frozenset()
    assert sorted(ran) == ["a", "b", "busy"]  # no unit began during the drain
    await workers.stop()
