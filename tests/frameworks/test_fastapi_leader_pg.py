"""The FastAPI integration tells who leads: the status route's ``leader``, and the
``leader_metadata`` dependency that a follower uses to forward a request to the leader.
Two replicas of one app on a real server, each through its real lifespan."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import Depends, FastAPI

from pgleaderlock import LeaderLock, LockOptions, Participation
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST = timings(retry_s=0.05, health_interval_s=0.2)


def replica(dsn: str, name: str, address: str) -> tuple[FastAPI, LeaderLifespan]:
    lock = LeaderLock.from_name(
        name,
        dsn,
        **lock_args(
            FAST,
            options=LockOptions(
                participation=Participation(metadata={"address": address}, identity=address)
            ),
        ),
    )
    leader = LeaderLifespan(lock)
    app = FastAPI(lifespan=leader)
    app.include_router(leader.router())

    @app.post("/write")
    async def write(meta: dict[str, Any] = Depends(leader.leader_metadata)) -> Any:  # noqa: B008
        if lock.is_leader:
            return {"written_by": address}
        return {"forward_to": meta["address"]}

    return app, leader


@pytest.fixture
async def apps(pg_dsn: str) -> AsyncIterator[list[tuple[httpx.AsyncClient, LeaderLifespan]]]:
    name = f"fastapi-leader-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        out = []
        for address in ("http://a:8000", "http://b:8000"):
            app, leader = replica(pg_dsn, name, address)
            manager = await stack.enter_async_context(LifespanManager(app))
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=httpx.ASGITransport(manager.app), base_url="http://t")
            )
            out.append((client, leader))
            if len(out) == 1:
                assert await leader.lock.wait_for_leadership(10)
        yield out


async def test_status_route_shows_who_leads_on_every_replica(
    apps: list[tuple[httpx.AsyncClient, LeaderLifespan]],
) -> None:
    (client_a, a), (client_b, b) = apps

    expected = ("http://a:8000", {"address": "http://a:8000"}, a.lock.backend_pid)
    for client in (client_a, client_b):
        await eventually(functools.partial(_shows, client, expected), what="a shown")
    await a.lock.step_down()
    assert await b.lock.wait_for_leadership(10)
    expected = ("http://b:8000", {"address": "http://b:8000"}, b.lock.backend_pid)
    for client in (client_a, client_b):
        await eventually(functools.partial(_shows, client, expected), what="b shown")


async def test_a_follower_forwards_to_the_leader(
    apps: list[tuple[httpx.AsyncClient, LeaderLifespan]],
) -> None:
    (client_a, _a), (client_b, _b) = apps
    assert (await client_a.post("/write")).json() == {"written_by": "http://a:8000"}
    assert (await client_b.post("/write")).json() == {"forward_to": "http://a:8000"}


async def _shows(client: httpx.AsyncClient, expected: object) -> bool:
    leader = (await client.get("/leader")).json()["leader"]
    return bool(leader) and (leader["identity"], leader["metadata"], leader["pid"]) == expected


async def _eq(value: Awaitable[object], expected: object) -> bool:
    return bool(await value == expected)
