"""The FastAPI integration on the in-memory FakeServer: lifespan composition and order,
the status route and dependencies, and the import error without the extra."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import Depends, FastAPI, Request

from pgleaderlock import (
    ConnectionError,
    FixedInterval,
    LeaderLock,
    LockState,
    ServerRefusedError,
)
from pgleaderlock.integrations.fastapi import LeaderLifespan, LeaderStatus
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock
from support.poll import eventually

S = LockState
pytestmark = pytest.mark.timeout(30)


def client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")  # type: ignore[arg-type]


async def test_lifespan_alone_starts_and_stops_the_lock(
    make_lock: MakeLock, server: FakeServer
) -> None:
    lock = make_lock()
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
    make_lock: MakeLock,
) -> None:
    lock = make_lock()
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
        await eventually(lambda: "task started" in events)
        assert (await http.get("/pool")).json() == {"pool": "the-pool"}  # state passed on
    assert events == [
        "app startup, lock stopped",
        "task started",
        "task stopped",
        "app shutdown, lock stopped",
    ]


async def test_status_route_and_dependencies(make_lock: MakeLock) -> None:
    a = make_lock(name="fake-lock")
    b = make_lock(name="fake-lock")
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
            await eventually(lambda: b.state in (S.FOLLOWER, S.ACQUIRING))
            await eventually(lambda: a.leader_since is not None)

            ra = await http_a.get("/leader")
            assert ra.status_code == 200
            body = ra.json()
            assert body["name"] == "fake-lock"
            assert body["keys"] == [1, 2]
            assert body["state"] == "leader"
            assert body["is_leader"] is True
            assert body["leader_since"].endswith("Z") or "+00:00" in body["leader_since"]
            await eventually(lambda: leaders[a].tasks.running == ["singleton"])
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


async def test_a_lock_stopped_on_a_permanent_error_is_not_ready(
    make_lock: MakeLock, server: FakeServer
) -> None:
    """The lock stops on an error that retrying cannot mend: the status shows the error,
    and neither the status route nor the readiness route looks healthy."""
    server.refuse_connections = ServerRefusedError('password authentication failed for "app"')
    lock = make_lock(name="refused")
    leader = LeaderLifespan(lock)
    app = FastAPI(lifespan=leader)
    app.include_router(leader.router())
    async with LifespanManager(app) as manager, client(manager.app) as http:
        with pytest.raises(ServerRefusedError):
            await lock.wait_for_leadership(5)
        assert lock.state is S.STOPPED
        for path in ("/leader", "/leader/ready"):
            response = await http.get(path)
            assert response.status_code == 503, path
            body = response.json()
            assert body["state"] == "stopped"
            assert body["ready"] is False
            assert body["is_leader"] is False
            assert body["last_error"] == (
                'ServerRefusedError: password authentication failed for "app"'
            )
        assert leader.status().ready is False


async def test_readiness_of_leader_follower_retrying_and_stopped_locks(
    make_lock: MakeLock, server: FakeServer
) -> None:
    """Ready while the lock takes part in the election (leader, follower, or retrying
    a connection error that may go away); not ready before startup and after shutdown."""
    a, b = make_lock(name="ready"), make_lock(name="ready")
    apps = {}
    for lock in (a, b):
        leader = LeaderLifespan(lock)
        apps[lock] = app = FastAPI(lifespan=leader)
        app.include_router(leader.router(follower_status_code=503, ready_path="/healthz"))
        app.include_router(leader.router("/plain", ready_path=None))

    async with client(apps[a]) as http:  # the lifespan has not run: the lock is stopped
        response = await http.get("/leader/healthz")
        assert response.status_code == 503
        assert response.json()["ready"] is False
        assert (await http.get("/plain/ready")).status_code == 404  # ready_path=None

    async with LifespanManager(apps[a]) as ma, client(ma.app) as http_a:
        assert await a.wait_for_leadership(5)
        async with LifespanManager(apps[b]) as mb, client(mb.app) as http_b:
            await eventually(lambda: b.statistics().failed_attempts > 0)
            assert (await http_a.get("/leader/healthz")).status_code == 200
            assert (await http_a.get("/leader")).status_code == 200
            follower = await http_b.get("/leader/healthz")
            assert follower.status_code == 200  # a follower is ready ...
            assert follower.json()["ready"] is True
            assert follower.json()["last_error"] is None
            assert (await http_b.get("/leader")).status_code == 503  # ... but not leader

            server.refuse_connections = ConnectionError("connection refused")
            for session in server.open_sessions:  # reconnecting fails, and is retried
                server.terminate(session)
            refused = "ConnectionError: connection refused"
            # the lost session's own error comes first; then each retry is refused
            await eventually(lambda: str(a.statistics().last_error) == "connection refused")
            await eventually(lambda: str(b.statistics().last_error) == "connection refused")
            for http in (http_a, http_b):
                retrying = await http.get("/leader/healthz")
                assert retrying.status_code == 200
                assert retrying.json()["ready"] is True
                assert retrying.json()["last_error"] == refused
            server.refuse_connections = None
            await eventually(lambda: a.is_leader or b.is_leader)
        assert b.state is S.STOPPED
        assert (await http_a.get("/leader/healthz")).status_code == 200
    async with client(apps[a]) as http:
        assert (await http.get("/leader/healthz")).status_code == 503  # after shutdown


async def test_two_leader_lifespans_combine_with_wrap(
    make_lock: MakeLock, server: FakeServer
) -> None:
    """``a.wrap(b)``: two locks in one app. ``b`` starts first and stops last, as the
    lifespan given to ``wrap`` does; each lock runs its own leader tasks."""
    lock_a = make_lock(name="a")
    lock_b = LeaderLock(
        None, 3, 4, name="b", connect_fn=server.connect, retry_strategy=FixedInterval(0.01)
    )
    a, b = LeaderLifespan(lock_a), LeaderLifespan(lock_b)
    events: list[str] = []
    for name, lock in (("a", lock_a), ("b", lock_b)):
        lock.on_state_change(
            lambda old, new, name=name: events.append(f"{name} {old.value}->{new.value}")
        )
    running: set[str] = set()

    def task_of(name: str) -> Callable[[], Awaitable[None]]:
        async def work() -> None:
            running.add(name)
            try:
                await asyncio.Event().wait()
            finally:
                running.discard(name)

        return work

    a.task(name="task-a")(task_of("a"))
    b.task(name="task-b")(task_of("b"))
    app = FastAPI(lifespan=a.wrap(b))
    app.include_router(a.router("/leader/a"))
    app.include_router(b.router("/leader/b"))
    try:
        async with LifespanManager(app) as manager, client(manager.app) as http:
            assert await lock_a.wait_for_leadership(5)
            assert await lock_b.wait_for_leadership(5)
            await eventually(lambda: running == {"a", "b"})
            assert (await http.get("/leader/a")).json()["name"] == "a"
            assert (await http.get("/leader/b")).json()["tasks"] == ["task-b"]
        assert lock_a.state is S.STOPPED
        assert lock_b.state is S.STOPPED
        assert running == set()
        assert events.index("b stopped->follower") < events.index("a stopped->follower")
        assert events.index("a releasing->stopped") < events.index("b releasing->stopped")
    finally:
        await lock_b.shutdown(timeout_s=5)


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
