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
app.include_router(leader.router())      # GET /leader: this replica's leadership
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
from ..core.models import LockState
from ..core.retry import RetryStrategy
from ..tasks import LeaderTasks, TaskFunction

__all__ = ["LeaderLifespan", "LeaderStatus"]

log = get_logger("pgleaderlock.integrations.fastapi")

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
        leader_since: when the current leadership began (UTC), or ``None``.
        tasks: names of the leader-only tasks running in this replica now.
    """

    name: str | None
    keys: tuple[int, int]
    state: LockState
    is_leader: bool
    leader_since: dt.datetime | None
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
        since = lock.leader_since
        return LeaderStatus(
            name=lock.name,
            keys=lock.keys,
            state=lock.state,
            is_leader=lock.is_leader,
            leader_since=None if since is None else dt.datetime.fromtimestamp(since, dt.UTC),
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
        tags: Sequence[str] = ("leadership",),
        include_in_schema: bool = True,
    ) -> APIRouter:
        """A router with ``GET path`` returning
        [`LeaderStatus`][pgleaderlock.integrations.fastapi.LeaderStatus] as JSON.

        Args:
            path: the route's path.
            follower_status_code: HTTP status when this replica is not the leader; the
                default 200 suits dashboards, 503 suits a load balancer or readiness
                probe that should pick the leader only.
            tags: OpenAPI tags.
            include_in_schema: list the route in the OpenAPI schema.
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
            if not status.is_leader:
                response.status_code = follower_status_code
            return status

        return router
