"""``GroupLifespan`` on a real PostgreSQL server: several FastAPI apps (replicas), each
with its own coordinator in one group, driven through their real lifespans and reached
through httpx's ASGI transport. The tasks spread over the replicas, each runs on one
replica at a time, a replica's shutdown moves its tasks to the others, and the status
and readiness routes say who leads what."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import Depends, FastAPI

from pgleaderlock import (
    ConfigurationError,
    Fencing,
    LeaderLock,
    LockOptions,
    PgLeaderLockError,
    WorkerContext,
)
from pgleaderlock.integrations.fastapi import GroupLifespan, GroupStatus, LeaderLifespan
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BOUND_S = 20.0  # generous: a name moves within a second here
# idle_tick_s: the views the status routes show refresh quickly
FAST = timings(retry_s=0.05, health_interval_s=0.5, idle_tick_s=0.5)
MODES = ["shared", "dedicated"]


@pytest.fixture
def group() -> str:
    """A group no other test uses (the server is shared)."""
    return f"t{uuid.uuid4().hex[:12]}"


class Cluster:
    """Which replica runs which task, as seen from the test; records any overlap."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.running: dict[str, set[str]] = {}
        self.starts: dict[str, list[str]] = {}
        self.violations: list[str] = []

    def names(self, count: int) -> list[str]:
        return [f"{self.group}:task{i}" for i in range(count)]

    async def _run(self, label: str, name: str) -> None:
        here = self.running.setdefault(name, set())
        if here:
            self.violations.append(f"{name} started on {label} while running on {here}")
        here.add(label)
        self.starts.setdefault(name, []).append(label)
        try:
            await asyncio.Event().wait()
        finally:
            here.discard(label)

    def replica(self, label: str, dsn: str, count: int, **kwargs: Any) -> GroupLifespan:
        lifespan = GroupLifespan(dsn, **lock_args({**FAST, **kwargs}, group=self.group))
        for i, name in enumerate(self.names(count)):
            if i % 2:  # half take their context, half take nothing

                async def with_context(ctx: WorkerContext, name: str = name) -> None:
                    assert ctx.name == name
                    await self._run(label, name)

                lifespan.task(name=name)(with_context)
            else:

                async def without_context(name: str = name) -> None:
                    await self._run(label, name)

                lifespan.task(name=name)(without_context)
        return lifespan

    def where(self) -> dict[str, str]:
        """Each name's one runner (names run nowhere or twice are left out)."""
        return {name: next(iter(who)) for name, who in self.running.items() if len(who) == 1}

    def shares(self) -> list[int]:
        counts: dict[str, int] = {}
        for label in self.where().values():
            counts[label] = counts.get(label, 0) + 1
        return sorted(counts.values())


def app_of(lifespan: GroupLifespan) -> FastAPI:
    app = FastAPI(lifespan=lifespan)
    app.include_router(lifespan.router())
    return app


@contextlib.asynccontextmanager
async def client(app: object) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
        yield http


@pytest.mark.parametrize("sessions", MODES)
async def test_tasks_spread_over_replicas_and_move_when_one_stops(
    pg_dsn: str, group: str, sessions: str
) -> None:
    cluster = Cluster(group)
    names = cluster.names(6)
    lifespans = {
        label: cluster.replica(label, pg_dsn, len(names), sessions=sessions) for label in "abc"
    }
    apps = {label: app_of(lifespan) for label, lifespan in lifespans.items()}

    async with client(apps["a"]) as http:  # not started yet: not ready
        for path in ("/group", "/group/ready"):
            early = await http.get(path)
            assert early.status_code == 503, path
            assert early.json()["ready"] is False

    managers: dict[str, LifespanManager] = {}
    try:
        for label, app in apps.items():
            managers[label] = LifespanManager(app)
            await managers[label].__aenter__()
        await eventually(
            lambda: len(cluster.where()) == len(names) and cluster.shares() == [2, 2, 2],
            BOUND_S,
            "six tasks spread 2/2/2 over three replicas",
        )
        where = cluster.where()
        members = {label: lifespans[label].coordinator.member for label in lifespans}

        def statuses_agree() -> bool:
            for _label, lifespan in lifespans.items():
                status = lifespan.status()
                if status.members != dict.fromkeys(members.values(), 2):
                    return False
                if status.leaders != {n: members[where[n]] for n in names}:
                    return False
            return True

        await eventually(statuses_agree, BOUND_S, "every replica's view is current")
        for label, manager in managers.items():
            async with client(manager.app) as http:
                response = await http.get("/group")
                assert response.status_code == 200
                body = GroupStatus.model_validate(response.json())
                mine = sorted(n for n, who in where.items() if who == label)
                assert body.group == group
                assert body.member == members[label]
                assert body.sessions == sessions
                assert body.ready is True
                assert body.names == sorted(names)
                assert body.owned == body.running == mine
                assert body.last_error is None
                assert (await http.get("/group/ready")).status_code == 200

        # Replica "a" stops (app shutdown): its tasks end before their names are
        # released, and the other two take them over, 3/3.
        gone = sorted(n for n, who in where.items() if who == "a")
        await managers.pop("a").__aexit__(None, None, None)
        assert all("a" not in cluster.running[n] for n in names)
        await eventually(
            lambda: len(cluster.where()) == len(names) and cluster.shares() == [3, 3],
            BOUND_S,
            "the stopped replica's tasks taken over, 3/3",
        )
        assert {cluster.where()[n] for n in gone} <= {"b", "c"}
        stopped = lifespans["a"].status()
        assert stopped.ready is False
        assert stopped.owned == stopped.running == []
        async with client(apps["a"]) as http:
            assert (await http.get("/group/ready")).status_code == 503
    finally:
        for manager in managers.values():
            await manager.__aexit__(None, None, None)
    assert cluster.violations == []
    assert all(not who for who in cluster.running.values())


async def test_task_names_arguments_and_context(pg_dsn: str, group: str) -> None:
    lifespan = GroupLifespan(
        pg_dsn,
        **lock_args(
            FAST, group=group, sessions="shared", options=LockOptions(fencing=Fencing(enabled=True))
        ),
    )
    seen: dict[str, object] = {}

    @lifespan.task
    async def default_name(ctx: WorkerContext) -> None:
        seen["ctx"] = ctx
        await asyncio.Event().wait()

    @lifespan.task(name=f"{group}:plain")
    async def plain() -> str:
        seen["plain"] = True
        return "done for this term"

    assert lifespan.coordinator.names == {f"{group}:default_name", f"{group}:plain"}
    with pytest.raises(ConfigurationError, match="already registered"):
        lifespan.task(name=f"{group}:plain")(plain)
    with pytest.raises(ConfigurationError, match="no argument or one"):

        @lifespan.task(name=f"{group}:two")  # type: ignore[type-var]
        async def two(ctx: WorkerContext, other: int) -> None: ...

    with pytest.raises(ConfigurationError, match="coroutine function"):
        lifespan.task(name=f"{group}:sync")(lambda: None)  # type: ignore[type-var]

    app = app_of(lifespan)
    owner_only = lifespan.require_owner(f"{group}:default_name")
    never_owned = lifespan.require_owner(f"{group}:unregistered")

    @app.get("/owner", dependencies=[Depends(owner_only)])
    async def owner() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/never", dependencies=[Depends(never_owned)])
    async def never() -> dict[str, bool]:
        return {"ok": True}

    async with LifespanManager(app) as manager, client(manager.app) as http:
        await eventually(lambda: "ctx" in seen and "plain" in seen, BOUND_S, "both tasks ran")
        ctx = seen["ctx"]
        assert isinstance(ctx, WorkerContext)
        assert ctx.name == f"{group}:default_name"
        assert ctx.member == lifespan.coordinator.member
        assert isinstance(ctx.term, int)  # fencing=True passed through to the coordinator
        status = lifespan.status()
        assert status.owned == sorted(lifespan.coordinator.names)
        assert status.running == [f"{group}:default_name"]  # plain returned: finished
        assert (await http.get("/owner")).status_code == 200
        refused = await http.get("/never")
        assert refused.status_code == 503
        assert "does not lead" in refused.json()["detail"]

        # A task registered while the app runs competes for its name at once.
        late = asyncio.Event()

        @lifespan.task(name=f"{group}:late")
        async def late_task() -> None:
            late.set()
            await asyncio.Event().wait()

        async with asyncio.timeout(BOUND_S):
            await late.wait()


async def test_a_task_that_keeps_crashing_moves_to_a_healthy_replica(
    pg_dsn: str, group: str
) -> None:
    """``give_away_after_crashes`` passes through to the coordinator: the name of a
    task that crashes on one replica only ends up on the other."""
    name = f"{group}:fragile"
    runs: dict[str, int] = {"sick": 0, "healthy": 0}
    lifespans = {}
    for label in ("sick", "healthy"):
        lifespan = GroupLifespan(
            pg_dsn,
            **lock_args(
                FAST,
                group=group,
                sessions="shared",
                give_away_after_crashes=2,
                give_away_cooldown_s=60,
            ),
        )

        async def task(label: str = label) -> None:
            runs[label] += 1
            if label == "sick":
                raise RuntimeError("broken on this replica")
            await asyncio.Event().wait()

        lifespan.task(name=name)(task)
        lifespans[label] = lifespan

    async with LifespanManager(app_of(lifespans["sick"])):
        await eventually(lambda: runs["sick"] >= 2, BOUND_S, "the sick replica crashed twice")
        async with LifespanManager(app_of(lifespans["healthy"])):
            await eventually(
                lambda: name in lifespans["healthy"].coordinator.running,
                BOUND_S,
                "the healthy replica runs the task",
            )
            assert runs["sick"] == 2
            assert lifespans["sick"].status().owned == []


async def test_a_permanent_error_fails_the_app_startup(group: str) -> None:
    bad = "postgresql://postgres@127.0.0.1:5432/pgleaderlock_no_such_database"
    lifespan = GroupLifespan(bad, **lock_args(FAST, group=group, sessions="shared"))

    @lifespan.task
    async def never() -> None: ...

    with pytest.raises(PgLeaderLockError):
        async with LifespanManager(app_of(lifespan)):
            pass
    assert lifespan.status().ready is False


async def test_wrap_orders_own_lifespan_leader_lifespan_and_group(
    pg_dsn: str, group: str, lock_name: str
) -> None:
    """``GroupLifespan.wrap`` composes like ``LeaderLifespan.wrap``: the wrapped
    lifespans start first and stop last."""
    order: list[str] = []
    lifespan = GroupLifespan(pg_dsn, **lock_args(FAST, group=group, sessions="dedicated"))
    leader = LeaderLifespan(LeaderLock.from_name(lock_name, pg_dsn))

    @lifespan.task(name=f"{group}:job")
    async def job() -> None:
        order.append("group task")
        await asyncio.Event().wait()

    @leader.task
    async def singleton() -> None:
        order.append("leader task")
        await asyncio.Event().wait()

    @contextlib.asynccontextmanager
    async def own(app: FastAPI) -> AsyncIterator[dict[str, str]]:
        order.append("own startup")
        yield {"pool": "ready"}
        order.append("own shutdown")

    app = FastAPI(lifespan=lifespan.wrap(leader.wrap(own)))
    async with LifespanManager(app):
        await eventually(lambda: len(order) == 3, BOUND_S, "both tasks started")
        assert order[0] == "own startup"
        assert set(order[1:]) == {"group task", "leader task"}
        assert lifespan.status().running == [f"{group}:job"]
    assert order[-1] == "own shutdown"
    assert lifespan.coordinator.owned == frozenset()
    assert not leader.lock.is_leader
