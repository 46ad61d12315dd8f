"""The FastAPI integration on the in-memory FakeServer: lifespan composition and order,
the status route and dependencies, and the import error without the extra."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import Depends, FastAPI, Request

from pgleaderlock import FixedInterval, LeaderLock, LockState
from pgleaderlock.integrations.fastapi import LeaderLifespan, LeaderStatus
from pgleaderlock.testing import FakeServer

S = LockState
pytestmark = pytest.mark.timeout(30)


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")  # type: ignore[arg-type]


async def test_lifespan_alone_starts_and_stops_the_lock(
    fake_lock: Callable[..., LeaderLock], server: FakeServer
) -> None:
    lock = fake_lock()
    leader = LeaderLifespan(lock)
    started = asyncio.Event()

    @leader.task
    async def work() -> None:
        started.set()
        await asyncio.Event().wait()

    app = FastAPI(lifespan=leader)
    assert lock.state is S.STOPPED
    async with LifespanManager(app):
        assert lock.state is not S.STOPPED
        async with asyncio.timeout(10):
            await started.wait()
        assert leader.tasks.running == ["work"]
    assert lock.state is S.STOPPED
    assert leader.tasks.running == []
    assert server.open_sessions == []
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("pgleaderlock")]


async def test_wrap_runs_both_lifespans_in_a_clear_order(
    fake_lock: Callable[..., LeaderLock],
) -> None:
    lock = fake_lock()
    leader = LeaderLifespan(lock)
    events: list[str] = []

    @leader.task
    async def work() -> None:
        events.append("task started")
        try:
            await asyncio.Event().wait()
        finally:
            events.append("task stopped")

    @leader.wrap
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, str]]:
        events.append(f"app startup, lock {lock.state.value}")
        yield {"pool": "the-pool"}
        events.append(f"app shutdown, lock {lock.state.value}")

    app = FastAPI(lifespan=lifespan)

    @app.get("/pool")
    async def pool(request: Request) -> dict[str, str]:
        return {"pool": request.state.pool}

    async with LifespanManager(app) as manager, client(manager.app) as http:
        await until(lambda: "task started" in events)
        assert (await http.get("/pool")).json() == {"pool": "the-pool"}  # state passed on
    assert events == [
        "app startup, lock stopped",
        "task started",
        "task stopped",
        "app shutdown, lock stopped",
    ]


async def test_status_route_and_dependencies(fake_lock: Callable[..., LeaderLock]) -> None:
    a = fake_lock(name="fake-lock")
    b = fake_lock(name="fake-lock")
    apps, leaders = {}, {}
    for lock in (a, b):
        leader = leaders[lock] = LeaderLifespan(lock)

        @leader.task(name="singleton")
        async def singleton() -> None:
            await asyncio.Event().wait()

        app = FastAPI(lifespan=leader)
        app.include_router(leader.router(follower_status_code=503))
        app.include_router(leader.router("/dashboard/leader"))

        @app.post("/rebalance", dependencies=[Depends(leader.require_leader)])
        async def rebalance() -> dict[str, bool]:
            return {"ok": True}

        @app.get("/whoami")
        async def whoami(status: LeaderStatus = Depends(leader.status)) -> dict[str, object]:  # noqa: B008
            return {"leader": status.is_leader}

        apps[lock] = app

    async with LifespanManager(apps[a]) as ma, client(ma.app) as http_a:
        assert await a.wait_for_leadership(5)
        async with LifespanManager(apps[b]) as mb, client(mb.app) as http_b:
            await until(lambda: b.state in (S.FOLLOWER, S.ACQUIRING))
            await until(lambda: a.leader_since is not None)

            ra = await http_a.get("/leader")
            assert ra.status_code == 200
            body = ra.json()
            assert body["name"] == "fake-lock"
            assert body["keys"] == [1, 2]
            assert body["state"] == "leader"
            assert body["is_leader"] is True
            assert body["leader_since"].endswith("Z") or "+00:00" in body["leader_since"]
            await until(lambda: leaders[a].tasks.running == ["singleton"])
            assert (await http_a.get("/leader")).json()["tasks"] == ["singleton"]

            rb = await http_b.get("/leader")
            assert rb.status_code == 503
            assert rb.json()["is_leader"] is False
            assert rb.json()["leader_since"] is None
            assert rb.json()["tasks"] == []
            assert (await http_b.get("/dashboard/leader")).status_code == 200

            assert (await http_a.post("/rebalance")).status_code == 200
            assert (await http_b.post("/rebalance")).status_code == 503
            assert (await http_a.get("/whoami")).json() == {"leader": True}
            assert (await http_b.get("/whoami")).json() == {"leader": False}
            schema = (await http_a.get("/openapi.json")).json()
            assert "/leader" in schema["paths"]


def test_missing_fastapi_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "pgleaderlock.integrations.fastapi")
    with pytest.raises(ImportError, match=r"pip install 'pgleaderlock\[fastapi\]'"):
        importlib.import_module("pgleaderlock.integrations.fastapi")


def test_core_does_not_import_the_frameworks() -> None:
    code = (
        "import sys, pgleaderlock, pgleaderlock.integrations;"
        "bad = {'fastapi', 'starlette', 'apscheduler'} & set(sys.modules);"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_lifespan_can_run_again_on_a_new_event_loop(server: FakeServer) -> None:
    """Like two ``with TestClient(app)`` blocks: each runs the lifespan on a new loop."""
    lock = LeaderLock(None, 1, 2, connect_fn=server.connect, retry_strategy=FixedInterval(0.01))
    leader = LeaderLifespan(lock)
    runs: list[int] = []

    @leader.task
    async def work() -> None:
        runs.append(1)
        await asyncio.Event().wait()

    async def serve_once() -> None:
        async with leader.run():
            assert await lock.wait_for_leadership(5)
            while not runs:
                await asyncio.sleep(0.01)
            runs.clear()

    asyncio.run(serve_once())
    asyncio.run(serve_once())
    assert lock.state is S.STOPPED
    assert server.open_sessions == []
