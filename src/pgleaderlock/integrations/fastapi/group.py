"""[`GroupLifespan`][pgleaderlock.integrations.fastapi.GroupLifespan]: several
leader-only tasks spread over an app's replicas with a
[`Coordinator`][pgleaderlock.Coordinator], and its status route."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar, overload

from fastapi import APIRouter, HTTPException

from ...coordination import Coordinator, WorkerContext, WorkerFunction
from ...lowlevel import ConfigurationError, describe
from .lifespan import AppLifespan
from .models import GroupStatus
from .routes import NOT_READY_STATUS_CODE, status_router

__all__ = ["GroupLifespan", "GroupTaskFunction"]

GroupTaskFunction = Callable[[], Awaitable[object]] | Callable[[WorkerContext], Awaitable[object]]
"""A task of a [`GroupLifespan`][pgleaderlock.integrations.fastapi.GroupLifespan]: a
coroutine function without arguments, or with one, its
[`WorkerContext`][pgleaderlock.WorkerContext]."""

GF = TypeVar("GF", bound=GroupTaskFunction)


class GroupLifespan(AppLifespan):
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

        return status_router(
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
