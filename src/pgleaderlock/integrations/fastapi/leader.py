"""[`LeaderLifespan`][pgleaderlock.integrations.fastapi.LeaderLifespan]: one lock for the
lifetime of a FastAPI app, its leader-only tasks, its status and health routes."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from enum import Enum
from typing import Any, TypeVar, overload

from fastapi import APIRouter, HTTPException, Response

from ...health import DEFAULT_FAILING_S, DEFAULT_STALL_S, HealthReport, check, live
from ...lowlevel import (
    LeaderInfo,
    LeaderLock,
    LockState,
    RetryStrategy,
    ShutdownError,
    describe,
    get_logger,
    optional_positive,
    positive,
)
from ...tasks import LeaderTasks, TaskFunction
from .lifespan import AppLifespan
from .models import HealthStatus, LeaderStatus, LeaderView
from .routes import NOT_READY_STATUS_CODE, status_router

__all__ = ["LeaderLifespan"]

log = get_logger("pgleaderlock.integrations.fastapi")

TF = TypeVar("TF", bound=TaskFunction)


def _utc(timestamp: float | None) -> dt.datetime | None:
    return None if timestamp is None else dt.datetime.fromtimestamp(timestamp, dt.UTC)


class LeaderLifespan(AppLifespan):
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

        router = status_router(
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
