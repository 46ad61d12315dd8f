"""The FastAPI lifespan with a ``Semaphore``: three replicas of one app on two slots, each
driven through its real lifespan; the leader task runs on exactly two, the status route
says which, and a replica that leaves hands its slot (and the task) to the third."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from pgleaderlock import Semaphore
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.asgi import leader_view
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST_PG = timings(retry_s=0.05, health_interval_s=0.2)


async def test_the_leader_task_runs_on_two_of_three_replicas(pg_dsn: str) -> None:
    name = f"sema-fastapi-{uuid.uuid4().hex[:10]}"
    running: set[str] = set()
    apps: dict[str, FastAPI] = {}
    sems: dict[str, Semaphore] = {}
    for label in ("a", "b", "c"):
        sem = Semaphore(pg_dsn, name, **lock_args(FAST_PG, slots=2))
        leader = LeaderLifespan(sem)

        @leader.task(name="work")
        async def work(label: str = label) -> None:
            running.add(label)
            try:
                await asyncio.Event().wait()
            finally:
                running.discard(label)

        app = FastAPI(lifespan=leader)
        app.include_router(leader.router())
        apps[label], sems[label] = app, sem

    async with contextlib.AsyncExitStack() as stack:
        managers = {}
        for label, app in apps.items():
            managers[label] = await stack.enter_async_context(LifespanManager(app))
        await eventually(lambda: len(running) == 2, 10, "the task on two replicas")
        views = {label: await leader_view(app) for label, app in apps.items()}
        leading = {label for label, view in views.items() if view["is_leader"]}
        assert leading == running
        (spare,) = set(apps) - leading
        leaving = sorted(leading)[0]
        await sems[leaving].step_down()
        await eventually(lambda: spare in running, 10, "the spare takes the freed slot")
        assert len(running) == 2
        assert (await leader_view(apps[spare]))["is_leader"] is True
    assert running == set()
