"""The FastAPI integration's health routes on a real PostgreSQL server: ``/leader/live``
and ``/leader/health`` answer 503 while the lock is wedged (here a callback that does
not return, while the app's loop still serves requests), 200 for a healthy follower,
and 200 again once the lock runs on time."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from pgleaderlock import LeaderLock, LockState
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST_PG = timings(retry_s=0.05, health_interval_s=0.2, load_plugins=False)


def replica(lock: LeaderLock) -> FastAPI:
    leader = LeaderLifespan(lock)
    app = FastAPI(lifespan=leader)
    app.include_router(leader.router(stall_s=0.3))
    return app


async def test_health_routes_fail_for_a_wedged_lock_and_pass_for_a_follower(
    pg_dsn: str,
) -> None:
    name = f"otel-health-{random.randrange(10**9)}"
    wedged = LeaderLock.from_name(name, **lock_args(FAST_PG, dsn=pg_dsn))
    follower = LeaderLock.from_name(name, **lock_args(FAST_PG, dsn=pg_dsn))
    release = asyncio.Event()

    @wedged.on_acquired
    async def never_returns() -> None:  # a callback that hangs: the lock's task waits
        await release.wait()

    wedged_app, follower_app = replica(wedged), replica(follower)
    a = httpx.AsyncClient(transport=httpx.ASGITransport(app=wedged_app), base_url="http://a")
    b = httpx.AsyncClient(transport=httpx.ASGITransport(app=follower_app), base_url="http://b")
    async with a, b, LifespanManager(wedged_app):
        await eventually(lambda: wedged.state is LockState.LEADER, 10, "a leads")
        async with LifespanManager(follower_app):
            try:

                async def live_fails() -> bool:
                    return (await a.get("/leader/live")).status_code == 503

                await eventually(live_fails, 10, "/leader/live answers 503")
                body = (await a.get("/leader/live")).json()
                assert body["ok"] is False
                assert body["reasons"][0].startswith("wedged:")
                assert body["details"]["stalled_s"] >= 0.3
                assert (await a.get("/leader/health")).status_code == 503
                assert (await a.get("/leader/ready")).status_code == 200  # status: unchanged

                await eventually(lambda: follower.statistics().failed_attempts >= 1, 10, "waits")
                for route in ("/leader/live", "/leader/health"):
                    response = await b.get(route)
                    assert response.status_code == 200, response.json()
                    assert response.json()["details"]["state"] != "leader"
            finally:
                release.set()

            async def live_passes() -> bool:
                return (await a.get("/leader/live")).status_code == 200

            await eventually(live_passes, 10, "/leader/live answers 200 again")
            assert (await a.get("/leader/health")).status_code == 200
    # After the app's shutdown the lock is stopped: not ready, still alive.
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=follower_app), base_url="http://b"
    ) as b:
        assert (await b.get("/leader/health")).status_code == 503
        assert (await b.get("/leader/live")).status_code == 200
