"""APScheduler 3.x integration: singleton jobs across replicas.

Install with ``pip install 'pgleaderlock[apscheduler]'``. Every replica runs the same
scheduler configuration; each job runs on the leader only. Three shapes:

- [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only] wraps one job: on a
  follower the run is skipped with a log line. For a coroutine job, a run in progress is
  cancelled when leadership is lost.
- [`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler] binds a whole
  scheduler: it is paused on followers and resumed on the leader, so jobs are not even
  submitted on followers, and within a leadership term ``misfire_grace_time``, ``coalesce``
  and ``max_instances`` behave as APScheduler documents. On resume, run times that fell due
  while this replica was a follower are not replayed: they belonged to the leader of that
  time.
- [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only] spreads the jobs over
  the replicas: each job has a name, the replicas' [`Coordinator`][pgleaderlock.Coordinator]s
  share the names out, and a job runs on the replica that leads its name.

With ``LeaderLock(..., fencing=True)`` a run learns the term of the leadership it
started under: [`current_term`][pgleaderlock.integrations.apscheduler.current_term]
inside a ``leader_only`` job, and a bound scheduler's
[`term`][pgleaderlock.integrations.apscheduler.SchedulerBinding.term].

With ``AsyncIOScheduler`` use a [`LeaderLock`][pgleaderlock.LeaderLock] on the same event
loop. With ``BackgroundScheduler`` (threads, no event loop) wrap the lock in
[`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock], which runs it on an event loop in a
dedicated thread.

Example:

```python
lock = LeaderLock.from_name("reports", dsn=DSN)
scheduler = AsyncIOScheduler()
scheduler.add_job(send_report, "cron", minute="*/5")
bind_scheduler(scheduler, lock)
scheduler.start()
await lock.start()
```
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import datetime as dt
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, overload

from .._extras import missing_extra

try:
    from apscheduler.events import EVENT_SCHEDULER_STARTED
    from apscheduler.schedulers import SchedulerNotRunningError
    from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING
except ImportError as exc:  # pragma: no cover - exercised by a test that hides apscheduler
    raise missing_extra(__name__, "APScheduler 3.x", "apscheduler", exc) from exc

from ..coordination import Coordinator, WorkerContext
from ..core._logging import get_logger
from ..core.errors import ConfigurationError
from ..core.lock import LeaderLock
from ..core.models import LockState
from ..tasks import follow_state
from ..threaded import ThreadedLeaderLock

__all__ = [
    "SchedulerBinding",
    "bind_scheduler",
    "current_context",
    "current_term",
    "leader_only",
    "owned_only",
]

log = get_logger("pgleaderlock.integrations.apscheduler")

P = ParamSpec("P")
R = TypeVar("R")

CANCEL_TIMEOUT_S = 10.0
"""How long the lock (or the coordinator) waits for a cancelled coroutine run of a
``leader_only`` (or ``owned_only``) job to end."""


Leadership = LeaderLock | ThreadedLeaderLock
"""What the APScheduler helpers accept: a lock, or a lock running in its own thread."""


_RUN_TERM: contextvars.ContextVar[tuple[int | None]] = contextvars.ContextVar(
    "pgleaderlock_run_term"
)
"""Inside a run of a ``leader_only`` or ``owned_only`` job: a 1-tuple of the term it
started under."""
_RUN_CONTEXT: contextvars.ContextVar[WorkerContext] = contextvars.ContextVar(
    "pgleaderlock_run_context"
)
"""Inside a run of an ``owned_only`` job: the name's worker context."""


def current_term() -> int | None:
    """The fencing term of the leadership under which the current run of a
    [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only] job started (for
    an [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only] job: its name's
    term, as the coordinator's [`WorkerContext.term`][pgleaderlock.WorkerContext]).

    Call it anywhere inside the run: in the job, in a function it calls, in a task it
    creates or in ``asyncio.to_thread`` (each copies the run's context). The value is
    fixed for the run: it is the lock's [`term`][pgleaderlock.LeaderLock.term] when
    the run was let through, even if the lock has since lost and regained leadership
    under a newer term. So a run can tell whether it still works under the leadership
    it began in (``lock.fence(conn) != current_term()``: it does not), and can hand
    that term to an external system as a fencing token.

    ```python
    @leader_only(lock)
    async def relay() -> None:
        term = current_term()
        async with await psycopg.AsyncConnection.connect(DSN) as conn, conn.transaction():
            if await lock.fence(conn) != term:
                raise RuntimeError("leadership changed since this run began")
            ...
    ```

    Returns:
        The term; ``None`` when the lock (or coordinator) has no fencing
        (``fencing=False``).

    Raises:
        RuntimeError: called outside a run of a ``leader_only`` or ``owned_only`` job (a
            job of a bound
            scheduler that is not decorated with it reads
            [`SchedulerBinding.term`][pgleaderlock.integrations.apscheduler.SchedulerBinding.term]
            instead).
    """
    try:
        return _RUN_TERM.get()[0]
    except LookupError:
        raise RuntimeError(
            "current_term() is called outside a run of a job decorated with leader_only(lock)"
            " or owned_only(coordinator, name)"
        ) from None


def _leadership(lock: LeaderLock) -> tuple[bool, int | None]:
    """Whether ``lock`` leads, and its term, read together from any thread: the term
    first, then the state (a term read as None while the lock became leader in between
    is read again)."""
    term = lock.term
    if not lock.is_leader:
        return False, None
    if term is None:
        term = lock.term
        if term is None and not lock.is_leader:
            return False, None
    return True, term


def _run_context(term: int | None, ctx: WorkerContext | None) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(_RUN_TERM.set, (term,))
    if ctx is not None:
        context.run(_RUN_CONTEXT.set, ctx)
    return context


def current_context() -> WorkerContext:
    """The [`WorkerContext`][pgleaderlock.WorkerContext] of the name under which the
    current run of an [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only]
    job started: its name, its fencing term, and fenced checkpoints
    ([`load_checkpoint`][pgleaderlock.WorkerContext.load_checkpoint],
    [`save_checkpoint`][pgleaderlock.WorkerContext.save_checkpoint]).

    Like [`current_term`][pgleaderlock.integrations.apscheduler.current_term], it is
    fixed for the run and seen by the tasks and threads the run starts.

    ```python
    @owned_only(coord, "billing:invoices")
    async def invoice_batch() -> None:
        ctx = current_context()
        async with await psycopg.AsyncConnection.connect(DSN) as conn, conn.transaction():
            position = await ctx.load_checkpoint(conn) or 0
            await ctx.save_checkpoint(conn, await invoice_after(conn, position))
    ```

    Raises:
        RuntimeError: called outside a run of an ``owned_only`` job.
    """
    try:
        return _RUN_CONTEXT.get()
    except LookupError:
        raise RuntimeError(
            "current_context() is called outside a run of a job decorated with "
            "owned_only(coordinator, name)"
        ) from None


def _lock_of(source: Leadership) -> LeaderLock:
    if isinstance(source, ThreadedLeaderLock):
        return source.lock
    if isinstance(source, LeaderLock):
        return source
    raise ConfigurationError(f"expected a LeaderLock or ThreadedLeaderLock, got {source!r}")


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
            return _run_context(term, ctx).run(fn, *args, **kwargs)

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
                    context = _run_context(term, ctx)
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
    ``fencing=True``).

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


# ---------------------------------------------------------------------- bind_scheduler


class SchedulerBinding:
    """Keeps a scheduler paused while the lock is not LEADER, running while it is.

    Made by [`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler]; see
    there. [`sync`][pgleaderlock.integrations.apscheduler.SchedulerBinding.sync] is safe
    from any thread.
    """

    def __init__(self, scheduler: Any, lock: Leadership, *, catch_up_s: float = 0.0) -> None:
        if isinstance(catch_up_s, bool) or not (
            isinstance(catch_up_s, int | float) and catch_up_s >= 0
        ):
            raise ConfigurationError(f"catch_up_s must be a number >= 0, got {catch_up_s!r}")
        if not callable(getattr(scheduler, "pause", None)) or not hasattr(scheduler, "state"):
            raise ConfigurationError(f"expected an APScheduler 3.x scheduler, got {scheduler!r}")
        self._scheduler = scheduler
        self._lock = _lock_of(lock)
        self._catch_up = dt.timedelta(seconds=catch_up_s)
        self._mutex = threading.RLock()  # scheduler listeners may call sync() again
        self._closed = False
        self._term: int | None = None
        self._plugin = follow_state(self._lock, self._on_state_change)
        scheduler.add_listener(self._on_scheduler_started, EVENT_SCHEDULER_STARTED)
        self.sync()

    @property
    def scheduler(self) -> Any:
        """The bound scheduler."""
        return self._scheduler

    @property
    def active(self) -> bool:
        """True while the scheduler is running (not paused) under this binding."""
        return bool(self._scheduler.state == STATE_RUNNING)

    @property
    def term(self) -> int | None:
        """With ``fencing=True``: the fencing term of the leadership the scheduler was
        resumed under; ``None`` while it is not running under this binding, and always
        without fencing.

        Every run of a bound scheduler is submitted while the lock leads, so a job that
        reads this first thing learns the term it runs under. A run that outlives the
        leadership (the scheduler is paused, the run goes on) and reads it later gets
        ``None``, or a newer term after a re-acquisition: read it once at the start, or
        decorate the job with [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only]
        as well and call [`current_term`][pgleaderlock.integrations.apscheduler.current_term],
        which is fixed per run.
        """
        return self._term if self.active else None

    def close(self) -> None:
        """Stop following the lock; the scheduler stays as it is."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        if self._lock.plugins.is_registered(self._plugin):
            self._lock.plugins.unregister(self._plugin)
        self._scheduler.remove_listener(self._on_scheduler_started)

    def _on_state_change(self, old: LockState, new: LockState) -> None:
        if LockState.LEADER in (old, new):
            self.sync()

    def _on_scheduler_started(self, event: Any) -> None:
        self.sync()

    def sync(self) -> None:
        """Pause or resume the scheduler to match the lock's state now."""
        with self._mutex:
            if self._closed:
                return
            scheduler = self._scheduler
            leads, term = _leadership(self._lock)
            self._term = term
            try:
                if leads:
                    if scheduler.state == STATE_PAUSED:
                        self._skip_followers_runs()
                        scheduler.resume()
                        log.info("scheduler_resumed", lock=self._lock.label)
                elif scheduler.state == STATE_RUNNING:
                    scheduler.pause()
                    log.info("scheduler_paused", lock=self._lock.label)
            except SchedulerNotRunningError:
                pass  # shut down meanwhile: nothing to pause or resume

    def _skip_followers_runs(self) -> None:
        """Move every job whose next run time lies before the hand-over to its first
        fire time at or after it (or remove it if it has none, like a past date job)."""
        cutoff = dt.datetime.now(getattr(self._scheduler, "timezone", None) or dt.UTC)
        cutoff -= self._catch_up
        for job in self._scheduler.get_jobs():
            next_run = job.next_run_time
            if next_run is None or next_run >= cutoff:
                continue  # paused by the user, or not due yet
            upcoming = job.trigger.get_next_fire_time(None, cutoff)
            if upcoming is None or upcoming < cutoff:
                log.info(
                    "job_expired",
                    job=job.id,
                    lock=self._lock.label,
                    reason="its only run time passed earlier",
                )
                job.remove()
                continue
            log.debug(
                "job_fast_forwarded", job=job.id, lock=self._lock.label, was=next_run, now=upcoming
            )
            job.modify(next_run_time=upcoming)


def bind_scheduler(
    scheduler: Any, lock: Leadership, *, catch_up_s: float = 0.0
) -> SchedulerBinding:
    """Run ``scheduler``'s jobs only on the leader: paused on followers, resumed on it.

    Call it before or after ``scheduler.start()``: a scheduler that starts while the lock
    is not LEADER is paused before it processes any job (and a lock that is never
    started keeps it paused). The binding owns ``pause()``/``resume()`` from then on.

    When the lock leaves LEADER the scheduler is paused at once: no new run starts. A run
    already in progress is not interrupted (APScheduler cannot cancel one); decorate
    coroutine jobs with [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only]
    too if they must stop at once.

    When the lock becomes LEADER, every job whose next run time has already passed is
    first moved to its first fire time at or after now (minus ``catch_up_s``): those
    runs belonged to the previous leader, which may already have run them. Then the
    scheduler resumes, and APScheduler's own rules (``misfire_grace_time``,
    ``coalesce``, ``max_instances``) apply. Give interval triggers an explicit
    ``start_date`` (or use cron triggers) so that every replica computes the same run
    times.

    With ``fencing=True``, [`term`][pgleaderlock.integrations.apscheduler.SchedulerBinding.term]
    is the term the scheduler runs under.

    Args:
        scheduler: an APScheduler 3.x scheduler (``AsyncIOScheduler`` with a lock on the
            same loop, ``BackgroundScheduler`` with a
            [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock], ...).
        lock: the lock, or a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock].
        catch_up_s: run times up to this many seconds before the hand-over are left to
            APScheduler's misfire handling instead of being skipped. That closes the gap
            of a slow failover, at the price that such a run may execute on both the old
            and the new leader. Default 0: each run time runs at most once.

    Returns:
        The binding (keep it to
        [`close`][pgleaderlock.integrations.apscheduler.SchedulerBinding.close] it).
    """
    return SchedulerBinding(scheduler, lock, catch_up_s=catch_up_s)
