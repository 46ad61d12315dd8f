"""FastAPI integration: the lock's lifespan, leader-only background tasks, a status route.

Install with ``pip install 'pgleaderlock[fastapi]'``. One line to adopt:

```python
leader = LeaderLifespan(LeaderLock.from_name("my-app", dsn=DSN))

@leader.task
async def refresh_cache() -> None:  # runs on exactly one replica at a time
    while True:
        await do_refresh()
        await asyncio.sleep(30)

app = FastAPI(lifespan=leader)           # or lifespan=leader.wrap(your_lifespan)
app.include_router(leader.router())      # GET /leader, /leader/ready, /leader/live, /leader/health
```

Failover behaviour (see [`LeaderTasks`][pgleaderlock.LeaderTasks]): a leader task is
cancelled, and awaited, the moment the lock leaves LEADER, including RECONNECTING under flap
damping; it starts again from the beginning when the lock is LEADER again.

Several leader-only tasks spread over the replicas, each task on one replica at a time:
[`GroupLifespan`][pgleaderlock.integrations.fastapi.GroupLifespan], built on a
[`Coordinator`][pgleaderlock.Coordinator]:

```python
group = GroupLifespan(DSN, group="billing")

@group.task(name="billing:outbox")
async def relay_outbox() -> None: ...

@group.task(name="projection:invoices")
async def project(ctx: WorkerContext) -> None: ...  # fenced checkpoints with Fencing(enabled=True)

app = FastAPI(lifespan=group)
app.include_router(group.router())       # GET /group, GET /group/ready
```
"""

from __future__ import annotations

import abc
import datetime as dt
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from enum import Enum
from typing import Any, Literal, TypeVar, overload

from .._extras import missing_extra

try:
    from fastapi import APIRouter, HTTPException, Response
    from pydantic import BaseModel
except ImportError as exc:  # pragma: no cover - exercised by a test that hides fastapi
    raise missing_extra(__name__, "FastAPI", "fastapi", exc) from exc

from ..coordination import Coordinator, WorkerContext, WorkerFunction
from ..core._logging import get_logger
from ..core.config import optional_positive, positive
from ..core.errors import ConfigurationError, ShutdownError
from ..core.leader import LeaderInfo
from ..core.lock import LeaderLock
from ..core.machine import describe
from ..core.models import LockState
from ..core.retry import RetryStrategy
from ..health import DEFAULT_FAILING_S, DEFAULT_STALL_S, HealthReport, check, live
from ..tasks import LeaderTasks, TaskFunction

__all__ = [
    "GroupLifespan",
    "GroupStatus",
    "GroupTaskFunction",
    "HealthStatus",
    "LeaderLifespan",
    "LeaderStatus",
    "LeaderView",
]

log = get_logger("pgleaderlock.integrations.fastapi")

NOT_READY_STATUS_CODE = 503
"""HTTP status of the status and readiness routes while the lock is not ready."""

AppT = TypeVar("AppT")
StateT = TypeVar("StateT")
TF = TypeVar("TF", bound=TaskFunction)
ModelT = TypeVar("ModelT", bound=BaseModel)

GroupTaskFunction = Callable[[], Awaitable[object]] | Callable[[WorkerContext], Awaitable[object]]
"""A task of a [`GroupLifespan`][pgleaderlock.integrations.fastapi.GroupLifespan]: a
coroutine function without arguments, or with one, its
[`WorkerContext`][pgleaderlock.WorkerContext]."""

GF = TypeVar("GF", bound=GroupTaskFunction)


def _utc(timestamp: float | None) -> dt.datetime | None:
    return None if timestamp is None else dt.datetime.fromtimestamp(timestamp, dt.UTC)


class LeaderView(BaseModel):
    """Who leads, as the status route shows it (a
    [`LeaderInfo`][pgleaderlock.LeaderInfo]; see [Who leads](../guides/who-leads.md)).

    Attributes:
        pid: the leader's server backend pid.
        application_name: its session's ``application_name``.
        role: its session's role.
        identity: its ``identity``, when it published one.
        name: its lock name.
        priority: its ``priority``.
        metadata: the document it publishes (``metadata=``).
        since: when it announced its leadership (server clock).
        term: its fencing term, with fencing.
        trusted: whether its role is trusted (this replica's own, a superuser, or one
            of ``trusted_roles``); an untrusted leader is shown with nothing it
            published.
    """

    pid: int
    application_name: str | None
    role: str | None
    identity: str | None = None
    name: str | None = None
    priority: int | None = None
    metadata: dict[str, Any] | None = None
    since: dt.datetime | None = None
    term: int | None = None
    trusted: bool = False

    @classmethod
    def of(cls, info: LeaderInfo | None) -> LeaderView | None:
        """The view of ``info`` (its fields by name; ``keys`` left out)."""
        return None if info is None else cls.model_validate(info, from_attributes=True)


class LeaderStatus(BaseModel):
    """This replica's view of the leadership, as served by
    [`LeaderLifespan.router`][pgleaderlock.integrations.fastapi.LeaderLifespan.router].

    Attributes:
        name: the lock's name (``None`` for a lock made from raw keys).
        keys: the advisory lock keys ``[key1, key2]``.
        state: the lock's state: ``stopped``, ``follower``, ``acquiring``, ``leader``,
            ``reconnecting`` or ``releasing``.
        is_leader: True only in state ``leader``.
        ready: True while the lock takes part in the election (any state but
            ``stopped``), and during a cool-down after giving leadership away
            (``paused_until``). False before the app's startup, after its shutdown,
            and once the lock has stopped by itself, in particular on an error that
            retrying cannot mend (authentication failed, unknown database or role, a
            transaction-mode pooler): such a replica will never lead.
        leader_since: when the current leadership began (UTC), or ``None``.
        term: with ``Fencing(enabled=True)``, the fencing term of the current
            leadership ([`LeaderLock.term`][pgleaderlock.LeaderLock.term]); ``None``
            while not leader, and always without fencing. Terms exceed 2^32 (the
            server's timeline is in the high 32 bits) and stay below 2^53 for
            timelines below 2^21, so JavaScript clients read them exactly.
        last_error: the lock's last database error as ``"TypeName: message"``
            (passwords masked), from
            [`statistics()`][pgleaderlock.LeaderLock.statistics]; ``None`` when the last
            attempt succeeded.
        tasks: names of the leader-only tasks running in this replica now.
        paused_until: with ``give_away_after_crashes``: after a task crashed that many
            times in a row, this replica gave its leadership away and stays out of the
            election until then (UTC); ``None`` otherwise.
        leader: who leads the lock (any replica, this one included), as the process's
            leader watch was last told (``on_leader_changed``: milliseconds after a
            change); ``None`` while nobody leads, or before the watch first looked.
    """

    name: str | None
    keys: tuple[int, int]
    state: LockState
    is_leader: bool
    ready: bool
    leader_since: dt.datetime | None
    term: int | None
    last_error: str | None
    tasks: list[str]
    paused_until: dt.datetime | None = None
    leader: LeaderView | None = None


class HealthStatus(BaseModel):
    """A [health check][pgleaderlock.health]'s verdict, as served by
    [`LeaderLifespan.router`][pgleaderlock.integrations.fastapi.LeaderLifespan.router]'s
    ``/live`` and ``/health`` routes (200 when ``ok``, else 503).

    Attributes:
        ok: every condition holds.
        reasons: why not, one sentence each (``wedged: ...``, ``stopped``,
            ``failing for ...``).
        details: what the verdict was made from
            ([`HealthReport.details`][pgleaderlock.health.HealthReport]).
    """

    ok: bool
    reasons: list[str]
    details: dict[str, Any]

    @classmethod
    def of(cls, report: HealthReport) -> HealthStatus:
        return cls(ok=report.ok, reasons=list(report.reasons), details=dict(report.details))


class GroupStatus(BaseModel):
    """Who leads what in a group, as this replica sees it, as served by
    [`GroupLifespan.router`][pgleaderlock.integrations.fastapi.GroupLifespan.router].

    Attributes:
        group: the group's name.
        member: this replica's member id in the group (new at every process start).
        sessions: the coordinator's session mode, ``dedicated`` or ``shared``.
        ready: True while the coordinator runs (from the app's startup to its
            shutdown); False before and after, and once it stopped on an error that
            retrying cannot mend (``last_error`` says which).
        names: the task names registered in this replica.
        owned: the names this replica leads now.
        running: the names whose task runs in this replica now.
        members: the live members of the group and how many of these names each
            leads.
        leaders: for each name: the member that leads it, ``""`` for a session outside
            the group (for example a plain [`LeaderLock`][pgleaderlock.LeaderLock] on
            that name), ``null`` while nobody does.
        moves: how many names this replica has handed to other members so far.
        last_error: the error that stopped the coordinator, as ``"TypeName:
            message"``; ``None`` while it runs.

    ``members`` and ``leaders`` are the coordinator's last look at the group
    ([`Coordinator.view`][pgleaderlock.Coordinator.view]), at most ``idle_tick_s``
    old; ``owned`` and ``running`` are this replica's own, exact.
    """

    group: str
    member: str
    sessions: Literal["dedicated", "shared"]
    ready: bool
    names: list[str]
    owned: list[str]
    running: list[str]
    members: dict[str, int]
    leaders: dict[str, str | None]
    moves: int
    last_error: str | None


class _AppLifespan(abc.ABC):
    """What the lifespans share: the lifespan protocol, composition with other
    lifespans, and the status routes."""

    @abc.abstractmethod
    def run(self) -> AbstractAsyncContextManager[None]:
        """Start, and on exit stop (the building block of the lifespan)."""

    def __call__(self, app: object) -> AbstractAsyncContextManager[None]:
        """The FastAPI lifespan: ``FastAPI(lifespan=leader)``."""
        return self.run()

    def wrap(
        self, lifespan: Callable[[AppT], AbstractAsyncContextManager[StateT]]
    ) -> Callable[[AppT], AbstractAsyncContextManager[StateT]]:
        """Compose with the app's own lifespan: ``FastAPI(lifespan=leader.wrap(lifespan))``.

        Order: your lifespan's startup runs first, then the lock (or coordinator)
        starts; at shutdown the lock is shut down (leader tasks stopped) first, then
        your lifespan's shutdown runs. So whatever your lifespan sets up (pools,
        clients) exists before any leader task starts and until every leader task has
        ended. Whatever your lifespan yields (a state dict, or nothing) is passed on
        unchanged. Usable as a decorator on top of ``@asynccontextmanager``.

        ``lifespan`` may be another ``LeaderLifespan`` or ``GroupLifespan``:
        ``a.wrap(b)`` runs both in one app (``b`` starts first and is shut down last);
        add ``a.wrap(b.wrap(your_lifespan))`` for your own lifespan as well.
        """

        @asynccontextmanager
        async def composed(app: AppT) -> AsyncIterator[StateT]:
            async with lifespan(app) as state, self.run():
                yield state

        return composed


def _status_router(
    kind: str,
    model: type[ModelT],
    status: Callable[[], ModelT],
    status_code: Callable[[ModelT], int | None],
    path: str,
    ready_path: str | None,
    tags: Sequence[str],
    include_in_schema: bool,
) -> APIRouter:
    """``GET path`` answering ``status()`` with ``status_code(status)`` (``None``:
    200), and ``GET path + ready_path`` answering 503 unless ``status().ready``."""
    router = APIRouter()
    route_tags: list[str | Enum] = list(tags)

    async def status_route(response: Response) -> Any:
        current = status()
        code = status_code(current)
        if code is not None:
            response.status_code = code
        return current

    router.get(
        path,
        response_model=model,
        tags=route_tags,
        include_in_schema=include_in_schema,
        name=f"{kind}_status",
        summary=f"This replica's {'leadership' if kind == 'leader' else 'view of its group'}",
    )(status_route)

    if ready_path is not None:

        async def ready_route(response: Response) -> Any:
            current = status()
            if not getattr(current, "ready", False):
                response.status_code = NOT_READY_STATUS_CODE
            return current

        what = "lock takes part in the election" if kind == "leader" else "coordinator runs"
        router.get(
            path.rstrip("/") + ready_path,
            response_model=model,
            tags=route_tags,
            include_in_schema=include_in_schema,
            name=f"{kind}_ready",
            summary=f"Whether this replica's {what}",
        )(ready_route)
    return router


class LeaderLifespan(_AppLifespan):
    """Runs a [`LeaderLock`][pgleaderlock.LeaderLock] for the lifetime of a FastAPI app.

    The instance is a FastAPI ``lifespan``: ``FastAPI(lifespan=leader)``. On startup it
    starts the lock (without waiting for leadership: the app serves requests as a
    follower too); on shutdown it shuts the lock down (which stops every leader task
    before the lock is released), then awaits any task still ending. To combine it with
    the app's own lifespan use [`wrap`][pgleaderlock.integrations.fastapi.LeaderLifespan.wrap].

    Args:
        lock: the lock; the lifespan owns it (starts and shuts it down).
        retry_strategy: delays between restarts of a crashed leader task; default: the
            lock's retry strategy.
        cancel_timeout_s: how long a cancelled leader task may take to end.
        shutdown_timeout_s: bound for the lock's shutdown at app shutdown; after it the
            lock's session is closed, which frees the lock on the server.
        give_away_after_crashes: after this many crashes in a row of one leader task,
            this replica releases the lock so that a healthy replica takes over, and
            stays out of the election for ``give_away_cooldown_s`` (see
            [`LeaderTasks`][pgleaderlock.LeaderTasks]); ``None`` (default): never.
        give_away_cooldown_s: how long a replica that gave its leadership away stays
            out of the election.
        watch_leader: keep who leads up to date for the status route (``leader``), with
            an ``on_leader_changed`` callback on the lock: the process's leader watch,
            two sessions per process ([Who leads](../guides/who-leads.md)). Only for a
            lock opened from a DSN (not with ``connect_fn``).
    """

    def __init__(
        self,
        lock: LeaderLock,
        *,
        retry_strategy: RetryStrategy | None = None,
        cancel_timeout_s: float = 10.0,
        shutdown_timeout_s: float = 30.0,
        give_away_after_crashes: int | None = None,
        give_away_cooldown_s: float = 60.0,
        watch_leader: bool = True,
    ) -> None:
        self._lock = lock
        self._leader: LeaderInfo | None = None
        if watch_leader and lock.backend is not None:
            lock.on_leader_changed(self._leader_changed)
        self._tasks = LeaderTasks(
            lock,
            retry_strategy=retry_strategy,
            cancel_timeout_s=cancel_timeout_s,
            give_away_after_crashes=give_away_after_crashes,
            give_away_cooldown_s=give_away_cooldown_s,
        )
        self._shutdown_timeout_s = shutdown_timeout_s

    @property
    def lock(self) -> LeaderLock:
        """The lock."""
        return self._lock

    @property
    def tasks(self) -> LeaderTasks:
        """The leader-only tasks."""
        return self._tasks

    # ------------------------------------------------------------------ tasks

    @overload
    def task(self, fn: TF, /) -> TF: ...

    @overload
    def task(self, fn: None = None, /, *, name: str | None = None) -> Callable[[TF], TF]: ...

    def task(self, fn: TaskFunction | None = None, /, *, name: str | None = None) -> Any:
        """Register a leader-only background task (decorator).

        ``@leader.task`` or ``@leader.task(name="sync")`` on a coroutine function without
        arguments. It starts when this replica becomes leader, is cancelled when it stops
        being leader, and starts again on re-acquisition. A crash is logged and the task
        restarted after a retry delay; leadership is not affected (unless
        ``give_away_after_crashes`` is set).
        """
        if fn is not None:
            return self._tasks.task(fn)
        return self._tasks.task(name=name)

    # ------------------------------------------------------------------ lifespan

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Start the lock, and on exit shut it down and await every leader task.

        The building block of the lifespan; usable on its own outside FastAPI. It may
        run again afterwards, on the same or on a new event loop (as two
        ``with TestClient(app)`` blocks do).
        """
        await self._lock.start()
        try:
            yield
        finally:
            await self._tasks.end_cooldown()  # a cool-down must not start the lock again
            try:
                await self._lock.shutdown(timeout_s=self._shutdown_timeout_s)
            except ShutdownError as exc:
                log.error("shutdown_failed", lock=self._lock.label, error=str(exc))
            finally:
                self._leader = None  # the watch stopped with the lock
                await self._tasks.stop()

    # ------------------------------------------------------------------ status

    def _leader_changed(self, info: LeaderInfo | None) -> None:
        self._leader = info

    async def current_leader(self) -> LeaderInfo | None:
        """A dependency: who leads now, read from the server
        ([`LeaderLock.leader`][pgleaderlock.LeaderLock.leader]; one query on the
        process's leader watch session). ``None`` while nobody leads.

        Raises:
            HTTPException: 503 when the server cannot be asked.
        """
        try:
            return await self._lock.leader()
        except Exception as exc:
            log.warning("leader_unknown", lock=self._lock.label, error=repr(exc))
            raise HTTPException(status_code=503, detail="who leads is unknown") from exc

    async def leader_metadata(self) -> dict[str, Any]:
        """A dependency for forwarding a request to the leader: the ``metadata`` the
        current leader publishes (its address...), read from the server.

        ``async def write(meta: dict = Depends(leader.leader_metadata))``.

        Raises:
            HTTPException: 503 when nobody leads, the leader's role is not trusted (see
                [`LeaderInfo.trusted`][pgleaderlock.LeaderInfo]: what such a leader
                publishes is never read), the leader published no metadata, or the
                server cannot be asked.
        """
        info = await self.current_leader()
        if info is None:
            raise HTTPException(status_code=503, detail="nobody leads")
        if not info.trusted:
            detail = f"the leader's role {info.role!r} is not trusted: its metadata is not read"
            raise HTTPException(status_code=503, detail=detail)
        if info.metadata is None:
            raise HTTPException(status_code=503, detail="the leader published no metadata")
        return dict(info.metadata)

    def status(self) -> LeaderStatus:
        """This replica's leadership now; also usable as a dependency
        (``Depends(leader.status)``)."""
        lock = self._lock
        stats = lock.statistics()
        paused = self._tasks.paused_until
        return LeaderStatus(
            name=lock.name,
            keys=lock.keys,
            state=stats.state,
            is_leader=stats.state is LockState.LEADER,
            ready=stats.state is not LockState.STOPPED or paused is not None,
            leader_since=_utc(stats.leader_since),
            term=stats.term,
            last_error=None if stats.last_error is None else describe(stats.last_error),
            tasks=self._tasks.running,
            paused_until=_utc(paused),
            leader=LeaderView.of(self._leader),
        )

    async def require_leader(self) -> None:
        """A dependency for leader-only endpoints: 503 unless this replica is leader.

        ``@app.post("/rebalance", dependencies=[Depends(leader.require_leader)])``.
        """
        if not self._lock.is_leader:
            raise HTTPException(status_code=503, detail="this replica is not the leader")

    def router(
        self,
        path: str = "/leader",
        *,
        follower_status_code: int = 200,
        ready_path: str | None = "/ready",
        tags: Sequence[str] = ("leadership",),
        include_in_schema: bool = True,
        live_path: str | None = "/live",
        health_path: str | None = "/health",
        stall_s: float = DEFAULT_STALL_S,
        failing_s: float | None = DEFAULT_FAILING_S,
    ) -> APIRouter:
        """A router with ``GET path`` returning
        [`LeaderStatus`][pgleaderlock.integrations.fastapi.LeaderStatus] as JSON, a
        readiness route ``GET path + ready_path`` (``/leader/ready``), and the
        [health checks][pgleaderlock.health] ``GET path + live_path``
        (``/leader/live``, liveness: 503 only while the lock is wedged) and
        ``GET path + health_path`` (``/leader/health``, readiness: 503 while wedged,
        stopped, or failing for longer than ``failing_s``), both answering
        [`HealthStatus`][pgleaderlock.integrations.fastapi.HealthStatus]. None of them
        depends on being the leader.

        Both answer **503** while the lock is not ready (``ready`` is false: the lock is
        stopped, before startup, after shutdown, or because it stopped on an error that
        retrying cannot mend; ``last_error`` then says which), so neither looks healthy
        for a replica that will never lead. The readiness route answers 200 otherwise,
        leader or follower: point a readiness probe at it. The body of both is the
        status.

        Args:
            path: the status route's path.
            follower_status_code: HTTP status of the status route when this replica is
                a ready follower; the default 200 suits dashboards, 503 suits a load
                balancer that should pick the leader only.
            ready_path: the readiness route's path below ``path``; ``None`` leaves it
                out.
            tags: OpenAPI tags.
            include_in_schema: list the routes in the OpenAPI schema.
            live_path: the liveness route's path below ``path``; ``None`` leaves it out.
            health_path: the health (readiness) route's path below ``path``; ``None``
                leaves it out. During a cool-down after giving leadership away
                (``paused_until``) the stopped lock counts as healthy.
            stall_s: how far behind its schedule the lock's task may be before both
                health routes fail ([`health.check`][pgleaderlock.health.check]).
            failing_s: how long errors may keep the lock from leading before the
                health route fails; ``None``: never for that reason.

        A blocked event loop also blocks these routes when the app and the lock share
        it (the usual case): the probe then times out, which Kubernetes counts as a
        failure too; the 503 with ``wedged`` comes from a lock on another loop, or from
        a slow callback while the loop still serves requests.
        """

        stall_s = positive("stall_s", stall_s)  # refused here, not at the first probe
        failing_s = optional_positive("failing_s", failing_s)

        def status_code(status: LeaderStatus) -> int | None:
            if not status.ready:
                return NOT_READY_STATUS_CODE
            return None if status.is_leader else follower_status_code

        router = _status_router(
            "leader", LeaderStatus, self.status, status_code,
            path, ready_path, tags, include_in_schema,
        )  # fmt: skip
        base, route_tags = path.rstrip("/"), list[str | Enum](tags)

        def respond(report: HealthReport, response: Response) -> HealthStatus:
            if not report.ok:
                response.status_code = NOT_READY_STATUS_CODE
            return HealthStatus.of(report)

        if live_path is not None:

            async def live_route(response: Response) -> Any:
                return respond(live(self._lock, stall_s=stall_s), response)

            router.get(
                base + live_path, response_model=HealthStatus, tags=route_tags,
                include_in_schema=include_in_schema, name="leader_live",
                summary="Liveness: the lock's task runs on time (not wedged)",
            )(live_route)  # fmt: skip
        if health_path is not None:

            async def health_route(response: Response) -> Any:
                paused = self._tasks.paused_until is not None
                report = check(
                    self._lock, stall_s=stall_s, failing_s=failing_s, require_running=not paused
                )
                return respond(report, response)

            router.get(
                base + health_path, response_model=HealthStatus, tags=route_tags,
                include_in_schema=include_in_schema, name="leader_health",
                summary="Readiness: not wedged, not stopped, not failing for long",
            )(health_route)  # fmt: skip
        return router


class GroupLifespan(_AppLifespan):
    """Several leader-only tasks spread over the replicas of a FastAPI app: each task
    runs on exactly one replica at a time, the tasks are balanced over the replicas,
    and a replica's tasks are taken over when it stops or dies.

    Built on a [`Coordinator`][pgleaderlock.Coordinator]: each task is a named worker,
    its name a lock ([`lock_keys(name)`][pgleaderlock.lock_keys]). The instance is a
    FastAPI ``lifespan`` (``FastAPI(lifespan=group)``) that starts the coordinator with
    the app (without waiting for any name: the app serves requests meanwhile) and
    shuts it down with the app: every task is cancelled and awaited, then its name
    released, and the other replicas take the names over. Combine it with the app's
    own lifespan, or with a [`LeaderLifespan`][pgleaderlock.integrations.fastapi.LeaderLifespan],
    with [`wrap`][pgleaderlock.integrations.fastapi.GroupLifespan.wrap].

    A task runs as [`LeaderLifespan`][pgleaderlock.integrations.fastapi.LeaderLifespan]'s
    do, per name: started when this replica leads the name, cancelled and awaited as
    soon as it does not, started again from the beginning at its next leadership;
    restarted after a crash with the retry strategy; a task that returns has finished
    for this leadership of its name.

    Args:
        dsn: as for [`Coordinator`][pgleaderlock.Coordinator].
        group: the group's name, the same in every replica of the app.
        sessions: ``"dedicated"`` (a session per task name) or ``"shared"`` (three
            sessions per replica whatever the number of tasks); see
            [`Coordinator`][pgleaderlock.Coordinator].
        **coordinator_args: any other [`Coordinator`][pgleaderlock.Coordinator]
            argument: ``fencing``, ``give_away_after_crashes``,
            ``give_away_cooldown_s``, ``retry_strategy``, ``connect_fn``, the lock
            knobs, ...

    Raises:
        ConfigurationError: bad arguments (from the coordinator), before any I/O.
    """

    def __init__(
        self,
        dsn: Any = None,
        *,
        group: str,
        sessions: Literal["dedicated", "shared"] = "dedicated",
        **coordinator_args: Any,
    ) -> None:
        self._coordinator = Coordinator(dsn, group=group, sessions=sessions, **coordinator_args)
        self._running = False

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator (its [`owned`][pgleaderlock.Coordinator.owned],
        [`view()`][pgleaderlock.Coordinator.view], ...)."""
        return self._coordinator

    # ------------------------------------------------------------------ tasks

    @overload
    def task(self, fn: GF, /) -> GF: ...

    @overload
    def task(self, fn: None = None, /, *, name: str | None = None) -> Callable[[GF], GF]: ...

    def task(self, fn: GroupTaskFunction | None = None, /, *, name: str | None = None) -> Any:
        """Register a task (decorator): ``@group.task`` or ``@group.task(name="...")``.

        The task is a coroutine function without arguments, or with one argument, its
        [`WorkerContext`][pgleaderlock.WorkerContext] (the name, the fencing term with
        ``Fencing(enabled=True)``, fenced checkpoints).

        The name is the task's lock, shared by every replica and by every app on the
        database: give each task a name that says whose it is. Without ``name``, it
        is ``"<group>:<function name>"``. Registered after the app's startup, the task
        competes for its name at once.

        Raises:
            ConfigurationError: not a coroutine function, more than one required
                argument, or the name is taken in this replica.
        """

        def register(func: GroupTaskFunction) -> GroupTaskFunction:
            task_name = name if name is not None else f"{self._coordinator.group}:{_name_of(func)}"
            self._coordinator.add(task_name, _worker(func))
            return func

        return register(fn) if fn is not None else register

    # ------------------------------------------------------------------ lifespan

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Start the coordinator, and on exit shut it down (every task stopped, every
        name released, every session closed).

        The building block of the lifespan; usable on its own outside FastAPI. It may
        run again afterwards, on the same or on a new event loop.

        Raises:
            PgLeaderLockError: at startup, an error retrying cannot mend (a wrong
                password, an unknown database): the app does not start.
        """
        await self._coordinator.start()
        self._running = True
        try:
            yield
        finally:
            self._running = False
            await self._coordinator.shutdown()

    # ------------------------------------------------------------------ status

    def status(self) -> GroupStatus:
        """Who leads what in the group, as this replica sees it now; also usable as a
        dependency (``Depends(group.status)``)."""
        coord = self._coordinator
        view = coord.view()
        error = coord.stop_error
        return GroupStatus(
            group=coord.group,
            member=coord.member,
            sessions=coord.sessions,
            ready=self._running and coord.started,
            names=sorted(coord.names),
            owned=sorted(coord.owned),
            running=sorted(coord.running),
            members=dict(sorted(view.members.items())),
            leaders=dict(sorted(view.leaders.items())),
            moves=coord.moves,
            last_error=None if error is None else describe(error),
        )

    def require_owner(self, name: str) -> Callable[[], Awaitable[None]]:
        """A dependency for endpoints that must run where ``name`` is led: 503 unless
        this replica leads it.

        ``@app.post("/flush", dependencies=[Depends(group.require_owner("billing:outbox"))])``.
        """

        async def owner() -> None:
            if name not in self._coordinator.owned:
                raise HTTPException(status_code=503, detail=f"this replica does not lead {name}")

        return owner

    def router(
        self,
        path: str = "/group",
        *,
        ready_path: str | None = "/ready",
        tags: Sequence[str] = ("leadership",),
        include_in_schema: bool = True,
    ) -> APIRouter:
        """A router with ``GET path`` returning
        [`GroupStatus`][pgleaderlock.integrations.fastapi.GroupStatus] as JSON, and a
        readiness route ``GET path + ready_path`` (``/group/ready``).

        Both answer **503** while the coordinator is not ready (before startup, after
        shutdown, or stopped on an error that retrying cannot mend), 200 otherwise,
        whatever this replica leads. The body of both is the status.

        Args:
            path: the status route's path.
            ready_path: the readiness route's path below ``path``; ``None`` leaves it
                out.
            tags: OpenAPI tags.
            include_in_schema: list the routes in the OpenAPI schema.
        """

        def status_code(status: GroupStatus) -> int | None:
            return None if status.ready else NOT_READY_STATUS_CODE

        return _status_router(
            "group", GroupStatus, self.status, status_code,
            path, ready_path, tags, include_in_schema,
        )  # fmt: skip


def _name_of(fn: object) -> str:
    return str(getattr(fn, "__name__", None) or repr(fn))


def _worker(fn: GroupTaskFunction) -> WorkerFunction:
    """``fn`` as a coordinator's worker: ``fn(ctx)``, or ``fn()`` when it takes no
    argument."""
    if not inspect.iscoroutinefunction(fn):
        raise ConfigurationError(f"a task must be a coroutine function (async def), got {fn!r}")
    required = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(required) > 1:
        raise ConfigurationError(
            f"a task takes no argument or one (its WorkerContext), got {fn!r} with {len(required)}"
        )
    if required:
        return fn
    without_context: Callable[[], Awaitable[object]] = fn

    async def worker(ctx: WorkerContext) -> object:
        return await without_context()

    return worker
