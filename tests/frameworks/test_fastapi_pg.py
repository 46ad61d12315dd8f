"""The FastAPI integration on a real PostgreSQL server: two replicas of one app, each
driven through its real lifespan. Exactly one runs the leader task; terminating the
leader's backend moves the task to the other replica; shutdown leaves nothing behind.
The example app is also run as two uvicorn processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from psycopg.conninfo import make_conninfo

from pgleaderlock import LeaderLock, LockOptions, LockState, ServerRefusedError, Session
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.fixture_types import Terminate
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GRACEFUL_EXIT = (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
EXAMPLE_APP = Path(__file__).parents[2] / "examples" / "fastapi_app"
BOUND_S = 20.0  # generous: loss is noticed within health_interval_s + health_timeout_s
FAST_PG = timings(retry_s=0.05, health_interval_s=0.2)


class Cluster:
    """What the leader tasks of all replicas did, as seen from the test."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.starts: dict[str, int] = {}
        self.violations: list[str] = []
        self.events: list[str] = []

    def replica(self, pg_dsn: str, lock_name: str, label: str) -> tuple[FastAPI, LeaderLifespan]:
        lock = LeaderLock.from_name(lock_name, **lock_args(FAST_PG, dsn=pg_dsn))
        leader = LeaderLifespan(lock)

        @leader.task(name="singleton")
        async def singleton() -> None:
            self.starts[label] = self.starts.get(label, 0) + 1
            self.running.add(label)
            self.events.append(f"start {label}")
            try:
                while True:
                    if lock.state is not LockState.LEADER:
                        self.violations.append(f"{label} ran in state {lock.state.value}")
                    await asyncio.sleep(0.005)
            finally:
                self.running.discard(label)
                self.events.append(f"stop {label}")

        app = FastAPI(lifespan=leader)
        app.include_router(leader.router())
        return app, leader


async def leader_view(app: object) -> dict[str, object]:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
        response = await http.get("/leader")
        assert response.status_code == 200
        return response.json()  # type: ignore[no-any-return]


async def assert_steady_single_leader(
    cluster: Cluster, expected: str, views: Mapping[str, object]
) -> None:
    """For a while: exactly the expected replica runs the task and says it is leader."""
    for _ in range(20):
        assert cluster.running == {expected}
        for label, app in views.items():
            view = await leader_view(app)
            assert view["is_leader"] is (label == expected), view
            assert view["tasks"] == (["singleton"] if label == expected else []), view
        await asyncio.sleep(0.02)


async def test_two_replicas_failover_and_clean_shutdown(
    pg_dsn: str,
    lock_name: str,
    terminate: Terminate,
    sessions: Callable[[str], Awaitable[list[int]]],
) -> None:
    cluster = Cluster()
    app_a, leader_a = cluster.replica(pg_dsn, lock_name, "a")
    app_b, leader_b = cluster.replica(pg_dsn, lock_name, "b")
    leaders = {"a": leader_a, "b": leader_b}

    async with LifespanManager(app_a) as ma, LifespanManager(app_b) as mb:
        views = {"a": ma.app, "b": mb.app}
        await eventually(lambda: len(cluster.running) == 1, BOUND_S)
        (first,) = cluster.running
        second = "b" if first == "a" else "a"
        await eventually(
            lambda: leaders[second].lock.state in (LockState.ACQUIRING, LockState.FOLLOWER), BOUND_S
        )
        await assert_steady_single_leader(cluster, first, views)
        first_view = await leader_view(views[first])
        assert first_view["name"] == lock_name
        assert first_view["state"] == "leader"
        assert first_view["leader_since"] is not None

        await terminate(leaders[first].lock.backend_pid)
        await eventually(lambda: cluster.running == {second}, BOUND_S)
        assert not leaders[first].lock.is_leader
        await assert_steady_single_leader(cluster, second, views)
        assert cluster.starts == {first: 1, second: 1}

    # App shutdown: no task, no lock, no connection left behind.
    assert cluster.running == set()
    assert cluster.violations == []
    assert leader_a.lock.state is leader_b.lock.state is LockState.STOPPED
    assert leader_a.tasks.running == leader_b.tasks.running == []
    left = [t for t in asyncio.all_tasks() if t.get_name().startswith("pgleaderlock")]
    assert left == []
    deadline = time.monotonic() + BOUND_S
    while await sessions(lock_name):  # a closed backend takes a moment to disappear
        assert time.monotonic() < deadline, await sessions(lock_name)
        await asyncio.sleep(0.05)


async def test_shutting_down_the_leader_app_hands_over_without_overlap(
    pg_dsn: str, lock_name: str
) -> None:
    cluster = Cluster()
    app_a, leader_a = cluster.replica(pg_dsn, lock_name, "a")
    app_b, leader_b = cluster.replica(pg_dsn, lock_name, "b")
    app_c, leader_c = cluster.replica(pg_dsn, lock_name, "c")
    following = (LockState.ACQUIRING, LockState.FOLLOWER)
    manager_a = LifespanManager(app_a)
    await manager_a.__aenter__()
    a_open = True
    try:
        await eventually(lambda: cluster.running == {"a"}, BOUND_S)
        async with LifespanManager(app_b):
            await eventually(lambda: leader_b.lock.state in following, BOUND_S)
        assert leader_b.lock.state is LockState.STOPPED  # a follower's app stopped
        assert cluster.running == {"a"}
        async with LifespanManager(app_c):
            await eventually(lambda: leader_c.lock.state in following, BOUND_S)
            assert cluster.running == {"a"}
            a_open = False
            await manager_a.__aexit__(None, None, None)  # the leader's app stops
            await eventually(lambda: cluster.running == {"c"}, BOUND_S)
    finally:
        if a_open:
            await manager_a.__aexit__(None, None, None)
    # a's task ended before a released the lock, so before c could start its task.
    assert cluster.events == ["start a", "stop a", "start c", "stop c"]
    assert cluster.violations == []
    assert leader_a.lock.state is leader_c.lock.state is LockState.STOPPED


@pytest.mark.parametrize("backend", ["psycopg", "asyncpg"])
async def test_unknown_database_stops_the_lock_and_the_app_is_not_ready(
    pg_dsn: str, lock_name: str, backend: str
) -> None:
    """A permanent error (the database does not exist): the lock stops at once instead
    of retrying, the status shows why, and the readiness route answers 503."""
    dbname = f"no_such_db_{lock_name.replace('-', '_')}"
    parts = urlsplit(pg_dsn)
    if parts.scheme:
        dsn = urlunsplit(parts._replace(path="/" + dbname))
    elif backend == "psycopg":
        dsn = make_conninfo(pg_dsn, dbname=dbname)
    else:
        pytest.skip("asyncpg takes URLs only; the test DSN is in key=value form")
    lock = LeaderLock.from_name(
        lock_name,
        **lock_args(FAST_PG, dsn=dsn, options=LockOptions(session=Session(backend=backend))),
    )
    leader = LeaderLifespan(lock)
    app = FastAPI(lifespan=leader)
    app.include_router(leader.router())
    started = time.monotonic()
    # The lock stops within BOUND_S (asserted below): so may the app's startup.
    async with LifespanManager(app, startup_timeout=BOUND_S) as manager:
        with pytest.raises(ServerRefusedError):
            await lock.wait_for_leadership(BOUND_S)
        assert time.monotonic() - started < BOUND_S
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
            ready = await http.get("/leader/ready")
            status = await http.get("/leader")
    assert ready.status_code == status.status_code == 503
    body = ready.json()
    assert body["ready"] is False
    assert body["state"] == "stopped"
    assert body["last_error"].startswith("ServerRefusedError: ")
    assert dbname in body["last_error"]
    assert lock.statistics().errors == 1  # reported once, not retried


# ---------------------------------------------------------------------- the example app


def start_example(pg_dsn: str, lock_name: str, replica: str, uds: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PG_DSN": pg_dsn,
        "LOCK_NAME": lock_name,
        "REPLICA": replica,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app:app", "--uds", str(uds), "--log-level", "warning"],
        cwd=EXAMPLE_APP,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def example_view(uds: Path) -> dict[str, object] | None:
    transport = httpx.AsyncHTTPTransport(uds=str(uds))
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
        try:
            return (await http.get("/leader", timeout=5)).json()  # type: ignore[no-any-return]
        except httpx.TransportError:
            return None


async def test_example_app_two_uvicorn_replicas(
    pg_dsn: str, lock_name: str, sessions: Callable[[str], Awaitable[list[int]]], tmp_path: Path
) -> None:
    socks = {name: tmp_path / f"{name}.sock" for name in ("a", "b")}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, sock in socks.items():
            procs[name] = start_example(pg_dsn, lock_name, name, sock)

        async def views() -> dict[str, dict[str, object] | None]:
            return {name: await example_view(sock) for name, sock in socks.items()}

        async with asyncio.timeout(BOUND_S * 2):
            while True:
                seen = await views()
                leaders = [n for n, v in seen.items() if v and v["is_leader"]]
                if all(seen.values()) and len(leaders) == 1:
                    break
                await asyncio.sleep(0.1)
        (first,) = leaders
        second = "b" if first == "a" else "a"
        assert seen[first]["tasks"] == ["heartbeat"]  # type: ignore[index]
        assert seen[second]["tasks"] == []  # type: ignore[index]

        procs[first].send_signal(signal.SIGTERM)  # graceful: the lifespan releases the lock
        out, _ = await asyncio.to_thread(procs[first].communicate, timeout=BOUND_S)
        assert procs[first].returncode in GRACEFUL_EXIT, out
        assert "heartbeat stopped" in out, out
        assert "app shutdown" in out, out
        async with asyncio.timeout(BOUND_S):
            while not ((view := await example_view(socks[second])) and view["is_leader"]):
                await asyncio.sleep(0.05)
        assert view["tasks"] == ["heartbeat"]

        procs[second].send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(procs[second].communicate, timeout=BOUND_S)
        assert procs[second].returncode in GRACEFUL_EXIT, out
        assert "app shutdown" in out, out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
    deadline = time.monotonic() + BOUND_S
    while await sessions(lock_name):
        assert time.monotonic() < deadline, await sessions(lock_name)
        await asyncio.sleep(0.05)
