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
app.include_router(leader.router())      # GET /leader, GET /leader/ready
```

Failover behaviour (see [`LeaderTasks`][pgleaderlock.LeaderTasks]): a leader task is
cancelled, and awaited, the moment the lock leaves LEADER, including RECONNECTING under flap
damping; it starts again from the beginning when the lock is LEADER again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from enum import Enum
from typing import Any, TypeVar, overload

try:
    from fastapi import APIRouter, HTTPException, Response
    from pydantic import BaseModel
except ImportError as exc:  # pragma: no cover - exercised by a test that hides fastapi
    raise ImportError(
        "pgleaderlock.integrations.fastapi needs FastAPI: "
        "install it with pip install 'pgleaderlock[fastapi]'"
    ) from exc

from ..core._logging import get_logger
from ..core.errors import ShutdownError
from ..core.lock import LeaderLock
from ..core.machine import describe
from ..core.models import LockState
from ..core.retry import RetryStrategy
from ..tasks import LeaderTasks, TaskFunction

__all__ = ["LeaderLifespan", "LeaderStatus"]

log = get_logger("pgleaderlock.integrations.fastapi")

NOT_READY_STATUS_CODE = 503
"""HTTP status of the status and readiness routes while the lock is not ready."""

AppT = TypeVar("AppT")
StateT = TypeVar("StateT")
TF = TypeVar("TF", bound=TaskFunction)


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
            ``stopped``). False before the app's startup, after its shutdown, and once
            the lock has stopped by itself, in particular on an error that retrying
            cannot mend (authentication failed, unknown database or role, a
            transaction-mode pooler): such a replica will never lead.
        leader_since: when the current leadership began (UTC), or ``None``.
        term: with ``LeaderLock(..., fencing=True)``, the fencing term of the current
            leadership ([`LeaderLock.term`][pgleaderlock.LeaderLock.term]); ``None``
            while not leader, and always without fencing. Terms exceed 2^32 (the
            server's timeline is in the high 32 bits) and stay below 2^53 for
            timelines below 2^21, so JavaScript clients read them exactly.
        last_error: the lock's last database error as ``"TypeName: message"``
            (passwords masked), from
            [`statistics()`][pgleaderlock.LeaderLock.statistics]; ``None`` when the last
            attempt succeeded.
        tasks: names of the leader-only tasks running in this replica now.
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


class LeaderLifespan:
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
    """

    def __init__(
        self,
        lock: LeaderLock,
        *,
        retry_strategy: RetryStrategy | None = None,
        cancel_timeout_s: float = 10.0,
        shutdown_timeout_s: float = 30.0,
    ) -> None:
        self._lock = lock
        self._tasks = LeaderTasks(
            lock, retry_strategy=retry_strategy, cancel_timeout_s=cancel_timeout_s
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
        restarted after a retry delay; leadership is not affected.
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
            try:
                await self._lock.shutdown(timeout_s=self._shutdown_timeout_s)
            except ShutdownError as exc:
                log.error("shutdown_failed", lock=self._lock.label, error=str(exc))
            finally:
                await self._tasks.stop()

    def __call__(self, app: object) -> AbstractAsyncContextManager[None]:
        """The FastAPI lifespan: ``FastAPI(lifespan=leader)``."""
        return self.run()

    def wrap(
        self, lifespan: Callable[[AppT], AbstractAsyncContextManager[StateT]]
    ) -> Callable[[AppT], AbstractAsyncContextManager[StateT]]:
        """Compose with the app's own lifespan: ``FastAPI(lifespan=leader.wrap(lifespan))``.

        Order: your lifespan's startup runs first, then the lock starts; at shutdown the
        lock is shut down (leader tasks stopped) first, then your lifespan's shutdown
        runs. So whatever your lifespan sets up (pools, clients) exists before any
        leader task starts and until every leader task has ended. Whatever your
        lifespan yields (a state dict, or nothing) is passed on unchanged. Usable as a
        decorator on top of ``@asynccontextmanager``.

        ``lifespan`` may be another ``LeaderLifespan``: ``a.wrap(b)`` runs two locks in
        one app (``b`` starts first and is shut down last); add
        ``a.wrap(b.wrap(your_lifespan))`` for your own lifespan as well.
        """

        @asynccontextmanager
        async def composed(app: AppT) -> AsyncIterator[StateT]:
            async with lifespan(app) as state, self.run():
                yield state

        return composed

    # ------------------------------------------------------------------ status

    def status(self) -> LeaderStatus:
        """This replica's leadership now; also usable as a dependency
        (``Depends(leader.status)``)."""
        lock = self._lock
        stats = lock.statistics()
        since = stats.leader_since
        return LeaderStatus(
            name=lock.name,
            keys=lock.keys,
            state=stats.state,
            is_leader=stats.state is LockState.LEADER,
            ready=stats.state is not LockState.STOPPED,
            leader_since=None if since is None else dt.datetime.fromtimestamp(since, dt.UTC),
            term=stats.term,
            last_error=None if stats.last_error is None else describe(stats.last_error),
            tasks=self._tasks.running,
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
    ) -> APIRouter:
        """A router with ``GET path`` returning
        [`LeaderStatus`][pgleaderlock.integrations.fastapi.LeaderStatus] as JSON, and a
        readiness route ``GET path + ready_path`` (``/leader/ready``).

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
        """
        router = APIRouter()
        route_tags: list[str | Enum] = list(tags)

        @router.get(
            path,
            response_model=LeaderStatus,
            tags=route_tags,
            include_in_schema=include_in_schema,
            summary="This replica's leadership",
        )
        async def leader_status(response: Response) -> LeaderStatus:
            status = self.status()
            if not status.ready:
                response.status_code = NOT_READY_STATUS_CODE
            elif not status.is_leader:
                response.status_code = follower_status_code
            return status

        if ready_path is not None:

            @router.get(
                path.rstrip("/") + ready_path,
                response_model=LeaderStatus,
                tags=route_tags,
                include_in_schema=include_in_schema,
                summary="Whether this replica's lock takes part in the election",
            )
            async def leader_ready(response: Response) -> LeaderStatus:
                status = self.status()
                if not status.ready:
                    response.status_code = NOT_READY_STATUS_CODE
                return status

        return router
