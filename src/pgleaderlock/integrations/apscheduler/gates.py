"""Job decorators that let a run through only where this replica leads:
[`leader_only`][pgleaderlock.integrations.apscheduler.leader_only] (a lock's leadership)
and [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only] (a coordinator's
name). A coroutine run they let through is cancelled once the replica no longer leads."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, overload

from ...coordination import Coordinator, WorkerContext
from ...lowlevel import ConfigurationError, LeaderLock, LockState, get_logger
from ...lowlevel import Leadership as FencingToken
from ...tasks import follow_state
from .runs import Leadership, _leadership, _lock_of, _run_context

__all__ = ["CANCEL_TIMEOUT_S", "leader_only", "owned_only"]

log = get_logger("pgleaderlock.integrations.apscheduler")

P = ParamSpec("P")
R = TypeVar("R")

CANCEL_TIMEOUT_S = 10.0
"""How long the lock (or the coordinator) waits for a cancelled coroutine run of a
``leader_only`` (or ``owned_only``) job to end."""

# ---------------------------------------------------------------------- leader_only


@dataclass
class _Run:
    loop: asyncio.AbstractEventLoop
    task: asyncio.Task[Any]
    lost: bool = False


class _Gate(abc.ABC):
    """A job decorator that lets a run through only while this replica leads, and
    cancels the coroutine runs it let through once it no longer does. What "leads"
    means is a subclass's: a lock's leadership, or a coordinator's name."""

    def __init__(self, label: str) -> None:
        self._label = label  # what leads, for logs (the ``lock`` field)
        self._mutex = threading.Lock()
        self._runs: dict[asyncio.Task[Any], _Run] = {}

    decorator = "leader_only"
    """The public name of the decorator, for errors."""

    @abc.abstractmethod
    def _admit(self) -> tuple[bool, int | None, WorkerContext | None]:
        """Whether a run may start now, the term and the context it runs under
        (called with the mutex held, from any thread)."""

    @abc.abstractmethod
    def _skip(self, fn: Callable[..., Any]) -> None:
        """Log a skipped run."""

    def _bind(self, term: int | None) -> FencingToken | None:
        """The leadership of ``term`` that a run is bound to (``None``: none)."""
        return None

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]: ...

    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        if not callable(fn):
            raise ConfigurationError(f"{self.decorator} needs a callable, got {fn!r}")
        if inspect.iscoroutinefunction(fn):
            return self._wrap_async(fn)
        return self._wrap_sync(fn)

    def _wrap_sync(self, fn: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(fn)
        def run_if_leader(*args: P.args, **kwargs: P.kwargs) -> R | None:
            with self._mutex:
                leads, term, ctx = self._admit()
            if not leads:
                self._skip(fn)
                return None
            return _run_context(term, ctx, self._bind(term)).run(fn, *args, **kwargs)

        return run_if_leader

    def _wrap_async(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]:
        @functools.wraps(fn)
        async def run_if_leader(*args: P.args, **kwargs: P.kwargs) -> R | None:
            loop = asyncio.get_running_loop()
            with self._mutex:  # against a change of leadership in another thread
                leads, term, ctx = self._admit()
                if not leads:
                    run = None
                else:
                    context = _run_context(term, ctx, self._bind(term))
                    run = _Run(loop, loop.create_task(fn(*args, **kwargs), context=context))
                    self._runs[run.task] = run
            if run is None:
                self._skip(fn)
                return None
            try:
                result: R = await run.task
                return result
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if run.lost and run.task.cancelled() and current and not current.cancelling():
                    log.warning(
                        "job_cancelled",
                        job=getattr(fn, "__qualname__", repr(fn)),
                        reason="leadership lost",
                        lock=self._label,
                    )
                    return None
                raise
            finally:
                with self._mutex:
                    self._runs.pop(run.task, None)

        return run_if_leader

    async def _lost(self) -> None:
        """Leadership is gone: cancel every coroutine run in progress, and await those
        on this loop (bounded by ``CANCEL_TIMEOUT_S``)."""
        with self._mutex:
            runs = list(self._runs.values())
            self._runs.clear()
        here = asyncio.get_running_loop()
        local: list[asyncio.Task[Any]] = []
        for run in runs:
            run.lost = True
            if run.loop is here:
                run.task.cancel()
                local.append(run.task)
            else:
                with contextlib.suppress(RuntimeError):  # that loop has closed: run is over
                    run.loop.call_soon_threadsafe(run.task.cancel)
        if local:
            _, pending = await asyncio.wait(local, timeout=CANCEL_TIMEOUT_S)
            if pending:
                log.error(
                    "job_ignores_cancel",
                    jobs=len(pending),
                    lock=self._label,
                    timeout_s=CANCEL_TIMEOUT_S,
                )


class _LeaderOnly(_Gate):
    """The decorator returned by
    [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only]."""

    def __init__(self, lock: LeaderLock) -> None:
        super().__init__(lock.label)
        self._lock = lock
        follow_state(lock, self._on_state_change)

    def _admit(self) -> tuple[bool, int | None, WorkerContext | None]:
        leads, term = _leadership(self._lock)
        return leads, term, None

    def _bind(self, term: int | None) -> FencingToken | None:
        return None if term is None else self._lock.leadership(term=term)

    def _skip(self, fn: Callable[..., Any]) -> None:
        log.info(
            "job_skipped",
            job=getattr(fn, "__qualname__", repr(fn)),
            reason="not leader",
            state=self._lock.state,
            lock=self._lock.label,
        )

    async def _on_state_change(self, old: LockState, new: LockState) -> None:
        if old is LockState.LEADER and new is not LockState.LEADER:
            await self._lost()


def leader_only(lock: Leadership) -> _LeaderOnly:
    """Decorator: run the job only while ``lock`` is LEADER; skip it, with a log line
    (``job_skipped``, level INFO, logger ``pgleaderlock.integrations.apscheduler``), on
    a follower.

    Works with sync and ``async def`` jobs, under ``AsyncIOScheduler`` (async jobs on
    the loop, sync jobs in its thread pool) and ``BackgroundScheduler``. Leadership is
    checked when the run starts. For an ``async def`` job, a run in progress is
    cancelled the moment the lock leaves LEADER (the wrapper then returns ``None`` and
    logs ``job_cancelled``); a sync job cannot be interrupted, so a run in progress
    finishes: keep sync jobs short, or check ``lock.is_leader`` between steps.

    Inside a run, [`current_term`][pgleaderlock.integrations.apscheduler.current_term]
    returns the fencing term of the leadership the run started under (with
    ``fencing=True``), and ``lock.fence(conn)`` fences with it: a run that outlives its
    leadership (a sync run, or one that finishes after a loss) is refused, even if the
    lock leads again by then.

    Args:
        lock: a [`LeaderLock`][pgleaderlock.LeaderLock] (same event loop as the scheduler) or
            a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock].

    Returns:
        A decorator; the wrapped function returns the job's result, or ``None`` when
        the run was skipped or cancelled.

    Example:

    ```python
    @leader_only(lock)
    async def send_report() -> None: ...

    # A fixed start_date gives every replica the same run times (see the guide).
    EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    scheduler.add_job(send_report, "interval", minutes=5, start_date=EPOCH)
    ```
    """
    return _LeaderOnly(_lock_of(lock))


# ---------------------------------------------------------------------- owned_only


class _OwnedOnly(_Gate):
    """The decorator returned by
    [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only]: the name's worker
    on the coordinator does nothing but mark, while it runs, that this replica leads
    the name."""

    decorator = "owned_only"

    def __init__(self, coordinator: Coordinator, name: str) -> None:
        super().__init__(name)
        self._coordinator = coordinator
        self._context: WorkerContext | None = None  # while this replica leads the name
        coordinator.add(name, self._lead)

    @property
    def name(self) -> str:
        """The name the job runs under."""
        return self._label

    def _admit(self) -> tuple[bool, int | None, WorkerContext | None]:
        ctx = self._context
        return (False, None, None) if ctx is None else (True, ctx.term, ctx)

    def _skip(self, fn: Callable[..., Any]) -> None:
        log.debug(
            "job_skipped",
            job=getattr(fn, "__qualname__", repr(fn)),
            reason="name led elsewhere",
            lock=self._label,
        )

    async def _lead(self, ctx: WorkerContext) -> None:
        """The name's worker: runs exactly while this replica leads the name; when it
        is cancelled (the name is about to be released, or is lost), the runs in
        progress are cancelled and awaited first."""
        with self._mutex:
            self._context = ctx
        try:
            await asyncio.Event().wait()
        finally:
            with self._mutex:
                self._context = None
            await self._lost()


def owned_only(coordinator: Coordinator, name: str) -> _OwnedOnly:
    """Decorator: run the job only on the replica whose
    [`Coordinator`][pgleaderlock.Coordinator] leads ``name``; skip it elsewhere, with a
    log line (``job_skipped``, level DEBUG).

    Singleton jobs spread over the replicas: give each job a name, and every replica
    the same scheduler configuration and a coordinator of the same group. Each name is
    led by one replica at a time, the names are balanced over the replicas, and a
    replica's names are taken over when it stops or dies; each job runs where its name
    is led.

    ``owned_only`` registers ``name`` on the coordinator (as a worker that marks the
    leadership while it lasts): call it before or after the coordinator starts, once
    per name. Leadership is checked when a run starts; for an ``async def`` job, a run
    in progress is cancelled, and awaited, before the name is released or as soon as it
    is lost (the wrapper then returns ``None`` and logs ``job_cancelled``); a sync job
    cannot be interrupted, so a run in progress finishes.

    Inside a run, [`current_term`][pgleaderlock.integrations.apscheduler.current_term]
    returns the name's fencing term (with ``Coordinator(..., fencing=True)``), and
    [`current_context`][pgleaderlock.integrations.apscheduler.current_context] its
    [`WorkerContext`][pgleaderlock.WorkerContext], for fenced writes and checkpoints.

    Use it with ``AsyncIOScheduler`` and a coordinator on the same event loop (sync
    jobs run in the scheduler's thread pool and are checked from there).

    Args:
        coordinator: the replica's coordinator.
        name: the job's name in the group, and its lock
            ([`lock_keys(name)`][pgleaderlock.lock_keys]): say whose job it is, for
            example ``"billing:daily-report"``.

    Returns:
        A decorator; the wrapped function returns the job's result, or ``None`` when
        the run was skipped or cancelled.

    Raises:
        ConfigurationError: ``coordinator`` is not a Coordinator, or ``name`` is invalid
            or already registered on it.

    Example:

    ```python
    coord = Coordinator(DSN, group="reports")

    @owned_only(coord, "reports:daily")
    async def daily_report() -> None: ...

    @owned_only(coord, "reports:cleanup")
    async def cleanup() -> None: ...

    scheduler.add_job(daily_report, "cron", hour=6)
    scheduler.add_job(cleanup, "interval", minutes=10, start_date=EPOCH)
    scheduler.start()
    await coord.start()
    ```
    """
    if not isinstance(coordinator, Coordinator):
        raise ConfigurationError(f"owned_only needs a Coordinator, got {coordinator!r}")
    return _OwnedOnly(coordinator, name)


# ---------------------------------------------------------------------- the ledger
