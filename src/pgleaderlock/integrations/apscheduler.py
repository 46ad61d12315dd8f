"""APScheduler 3.x integration: singleton jobs across replicas.

Install with ``pip install 'pgleaderlock[apscheduler]'``. Every replica runs the same
scheduler configuration; each job runs on the leader only. Three shapes:

- [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only] wraps one job: on a
  follower the run is skipped with a log line. For a coroutine job, a run in progress is
  cancelled when leadership is lost.
- [`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler] binds a whole
  scheduler: it is paused on followers and resumed on the leader, so jobs are not even
  submitted on followers, and within a leadership term ``misfire_grace_time``, ``coalesce``
  and ``max_instances`` behave as APScheduler documents. With ``fencing=True`` (required
  unless ``ledger=False``) every run time is claimed in the schedule ledger before it
  runs, so it runs once across the fleet, and a new leader settles the run times that
  nobody ran (see ``catch_up`` and ``interrupted``).
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
lock = LeaderLock.from_name("reports", dsn=DSN, fencing=True)
scheduler = AsyncIOScheduler()
scheduler.add_job(send_report, "cron", minute="*/5", id="send_report")
bind_scheduler(scheduler, lock)
scheduler.start()
await lock.start()
```
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import datetime as dt
import functools
import inspect
import re
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, overload

from .._extras import missing_extra

try:
    from apscheduler.events import EVENT_EXECUTOR_ADDED, EVENT_SCHEDULER_STARTED
    from apscheduler.schedulers import SchedulerNotRunningError
    from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING
    from apscheduler.util import iscoroutinefunction_partial
except ImportError as exc:  # pragma: no cover - exercised by a test that hides apscheduler
    raise missing_extra(__name__, "APScheduler 3.x", "apscheduler", exc) from exc

from ..coordination import Coordinator, WorkerContext
from ..core._logging import get_logger
from ..core.config import not_negative
from ..core.errors import ConfigurationError, FencedError
from ..core.fencing import Leadership as FencingToken
from ..core.lock import LeaderLock, lock_settings
from ..core.models import LockState
from ..schedule.scheduler import (
    CatchUp,
    Interrupted,
    Job,
    Run,
    Scheduler,
    check_job_name,
    check_policy,
)
from ..tasks import follow_state
from ..threaded import ThreadedLeaderLock

__all__ = [
    "SchedulerBinding",
    "bind_scheduler",
    "current_context",
    "current_run",
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
    under a newer term. The run is bound to that leadership: ``lock.fence(conn)`` in it
    fences with this term, and is refused once that leadership has ended, even if the
    lock leads again. The term is also the token to hand to an external system.

    ```python
    @leader_only(lock)
    async def relay() -> None:
        term = current_term()
        async with await psycopg.AsyncConnection.connect(DSN) as conn, conn.transaction():
            await lock.fence(conn)  # with `term`: FencedError once it has ended
            await publish(conn, fencing_term=term)
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


def _run_context(
    term: int | None, ctx: WorkerContext | None, lead: FencingToken | None = None
) -> contextvars.Context:
    """The context a run runs in: its term and worker context, and bound to the
    leadership it started under (``lock.fence(conn)`` in it fences with that term)."""
    context = contextvars.copy_context()
    context.run(_RUN_TERM.set, (term,))
    if ctx is not None:
        context.run(_RUN_CONTEXT.set, ctx)
    if lead is not None:
        context.run(lead.__enter__)  # left bound: the context ends with the run
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

_NEVER = dt.datetime.max.replace(tzinfo=dt.UTC)
"""The "next slot" of a trigger that fires no more (a date job after its date)."""
_FOREVER_S = 100 * 365 * 86_400.0
"""``misfire_grace_time=None`` (run however late) as a number of seconds."""
_MS = dt.timedelta(milliseconds=1)


def _slot(when: dt.datetime) -> dt.datetime:
    """A run time as the ledger keys it: UTC, rounded to the millisecond. An interval
    trigger computes its run times in float seconds, one way on a replica that counts
    on from its previous run and another on one that starts afresh; the two may differ
    by a microsecond or two, and must still name the same slot."""
    when = when.astimezone(dt.UTC)
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return epoch + round((when - epoch) / _MS) * _MS


@dataclass(frozen=True)
class _TriggerTiming:
    """An APScheduler trigger as a [`Timing`][pgleaderlock.schedule.Timing]: the slots
    are its fire times (rounded to the millisecond)."""

    trigger: Any

    @property
    def spec(self) -> str:
        return f"apscheduler {self.trigger!r}"[:1000]

    def _fires(self, after: dt.datetime, through: dt.datetime, limit: int) -> list[dt.datetime]:
        """Fire times in ``(after, through]``, at most the first ``limit``."""
        found: list[dt.datetime] = []
        fire = self.trigger.get_next_fire_time(None, after + dt.timedelta(microseconds=1))
        while fire is not None and len(found) < limit:
            slot = _slot(fire)
            if slot > through:
                break
            if slot > after:
                found.append(slot)
            fire = self.trigger.get_next_fire_time(fire, fire)
        return found

    def after(self, when: dt.datetime) -> dt.datetime:
        fires = self._fires(when, _NEVER - dt.timedelta(days=1), 1)
        return fires[0] if fires else _NEVER

    def newest(
        self, after: dt.datetime, through: dt.datetime, count: int
    ) -> tuple[list[dt.datetime], int]:
        # Walk back from ``through`` in growing windows: a trigger only steps forward.
        if through <= after:
            return [], 0
        span = dt.timedelta(seconds=1)
        while True:
            low = max(after, through - span)
            found = self._fires(low, through, 4 * count + 4)
            if len(found) >= count or low == after or len(found) > 4 * count:
                break
            span *= 4
        kept = found[-count:] if count else []
        return kept, len(found) - len(kept)  # older: those seen in the last window


async def _timed_by_apscheduler(run: Run) -> None:  # pragma: no cover - never called
    raise RuntimeError("an APScheduler job's ledger entry is run by APScheduler")


_RUN: contextvars.ContextVar[Run] = contextvars.ContextVar("pgleaderlock_apscheduler_run")
"""Inside a run of a job of a scheduler bound in ledger mode: its claimed slot."""


def current_run() -> Run:
    """The ledger's [`Run`][pgleaderlock.schedule.Run] of the current run of a job of a
    scheduler bound with [`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler]
    (ledger mode, the default): its slot (the APScheduler run time), the fencing term
    it was claimed under, its attempt, how late it started, and
    [`run.transaction(conn)`][pgleaderlock.schedule.Run.transaction], a fenced
    transaction that marks the slot done when it commits (for ``async def`` jobs).

    ```python
    async def settle_invoices() -> None:
        run = current_run()
        async with await psycopg.AsyncConnection.connect(DSN) as conn:
            async with run.transaction(conn):  # commits once per slot, or not at all
                await conn.execute("INSERT INTO settlements (slot) VALUES (%s)", (run.slot,))
    ```

    Raises:
        RuntimeError: called outside such a run.
    """
    try:
        return _RUN.get()
    except LookupError:
        raise RuntimeError(
            "current_run() is called outside a run of a job of a scheduler bound with "
            "bind_scheduler(scheduler, lock) in ledger mode"
        ) from None


class _SlotLedger:
    """The ledger calls of a bound scheduler, made on the lock's event loop from the
    scheduler's threads or loops (each bounded by ``LEDGER_TIMEOUT_S``)."""

    def __init__(self, lock: LeaderLock, threaded: ThreadedLeaderLock | None, policy: _Policy):
        self.lock = lock
        self.schedule = Scheduler(lock)
        self.policy = policy
        self._threaded = threaded
        self.loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self.loop = asyncio.get_running_loop()  # a LeaderLock is bound on its own loop
        self._jobs: dict[tuple[str, str], Job] = {}
        self._warned: set[str] = set()

    def lock_loop(self) -> asyncio.AbstractEventLoop | None:
        if self._threaded is not None:
            return self._threaded.loop
        return self.loop

    def job(self, job: Any) -> Job | None:
        """The ledger's view of an APScheduler job (``None``: it cannot be claimed)."""
        trigger = job.trigger
        if getattr(trigger, "jitter", None):
            if job.id not in self._warned:
                self._warned.add(job.id)
                log.error("job_refused", job=job.id, lock=self.lock.label,
                          reason="a trigger with jitter has different run times on each "
                          "replica: the ledger cannot tell its runs apart")  # fmt: skip
            return None
        if _RANDOM_ID.fullmatch(job.id) and job.id not in self._warned:
            self._warned.add(job.id)
            log.warning("job_id_random", job=job.id, lock=self.lock.label,
                        reason="give the job an explicit id= (the default is random, so "
                        "every replica names its slots differently)")  # fmt: skip
        key = (job.id, repr(trigger))
        known = self._jobs.get(key)
        if known is None:
            grace = job.misfire_grace_time
            known = Job(
                name=check_job_name(job.id),
                fn=_timed_by_apscheduler,
                timing=_TriggerTiming(trigger),
                catch_up=self.policy.catch_up,
                max_catch_up=self.policy.max_catch_up,
                misfire_grace_s=_FOREVER_S if grace is None else float(grace),
                interrupted=self.policy.interrupted,
            )
            self._jobs[key] = known
        return known

    # Calls on the lock's loop, from anywhere.

    def call(self, make: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """From a thread that is not the lock loop's: run ``make()`` there and wait."""
        loop = self.lock_loop()
        if loop is None:
            raise ConnectionError("the lock is not running")
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                raise ConfigurationError(
                    "a sync job of a bound scheduler runs on the lock's event loop thread "
                    "(DebugExecutor?): the ledger cannot be called from there"
                )
        future = asyncio.run_coroutine_threadsafe(make(), loop)
        try:
            return future.result(LEDGER_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise ConnectionError(f"a ledger call took over {LEDGER_TIMEOUT_S} s") from None

    async def acall(self, make: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """From a coroutine on any loop: run ``make()`` on the lock's loop."""
        loop = self.lock_loop()
        if loop is None:
            raise ConnectionError("the lock is not running")
        try:
            async with asyncio.timeout(LEDGER_TIMEOUT_S):
                if asyncio.get_running_loop() is loop:
                    return await make()
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), loop))
        except TimeoutError:  # as `call`: a run skipped in one line, not a job's crash
            raise ConnectionError(f"a ledger call took over {LEDGER_TIMEOUT_S} s") from None


_RANDOM_ID = re.compile(r"[0-9a-f]{32}")
"""What APScheduler's default job id (``uuid4().hex``) looks like."""

LEDGER_TIMEOUT_S = 30.0
"""The bound of one ledger call from a job's thread or loop (a claim waits at most this
long, the server's clock included)."""

_NOT_CLAIMED = (ConnectionError, FencedError)
"""What a claim raises when the lock does not (or no longer) lead: the run is skipped."""


@dataclass(frozen=True)
class _Policy:
    catch_up: CatchUp
    max_catch_up: int
    interrupted: Interrupted


@dataclass(frozen=True)
class _Due:
    """A run time to claim, and how."""

    at: dt.datetime  # the run time as APScheduler gave it
    forced: bool = False  # chosen by the catch-up policy: run however late
    rerun: bool = False  # may take over a slot an older term left running


class _SlotJob:
    """What a bound scheduler's executor runs in place of ``job``: the same job, each of
    whose run times is first claimed in the ledger. APScheduler's ``run_job`` calls
    ``func`` once per run time, in order; the misfire check is made here (against the
    job's ``misfire_grace_time``) so that each call knows its run time."""

    def __init__(self, job: Any, spec: Job | None, due: list[_Due], ledger: _SlotLedger) -> None:
        self._job = job
        self._spec = spec
        self._due = collections.deque(due)
        self._ledger = ledger
        self.id = job.id
        self.name = job.name
        self.max_instances = job.max_instances
        self.misfire_grace_time = None  # checked in _next, per run time
        self._jobstore_alias = getattr(job, "_jobstore_alias", None)
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.func: Callable[[], Any] = (
            self._run_async if iscoroutinefunction_partial(job.func) else self._run_sync
        )

    def __str__(self) -> str:
        return str(self._job)

    def _next(self) -> _Due | None:
        due = self._due.popleft()
        grace = self._job.misfire_grace_time
        late = dt.datetime.now(dt.UTC) - due.at
        if grace is not None and not due.forced and late > dt.timedelta(seconds=grace):
            log.warning("run_missed", job=self.id, lock=self._ledger.lock.label,
                        run_time=due.at.isoformat(),
                        late_s=round(late.total_seconds(), 3))  # fmt: skip
            return None
        return due

    def _claimed(self, run: Run | None, due: _Due) -> None:
        if run is None:
            log.info("job_skipped", job=self.id, run_time=due.at.isoformat(),
                     reason="slot already claimed", lock=self._ledger.lock.label)  # fmt: skip

    def _not_claimed(self, due: _Due, exc: Exception) -> None:
        log.info("job_skipped", job=self.id, run_time=due.at.isoformat(),
                 reason="not leader", detail=str(exc), lock=self._ledger.lock.label)  # fmt: skip

    def _run_sync(self) -> Any:
        due = self._next()
        if due is None:
            return None
        ledger, spec, job = self._ledger, self._spec, self._job
        assert spec is not None  # a refused job has no run times
        try:
            run = ledger.call(lambda: ledger.schedule.claim(spec, _slot(due.at), rerun=due.rerun))
        except _NOT_CLAIMED as exc:
            self._not_claimed(due, exc)
            return None
        self._claimed(run, due)
        if run is None:
            return None
        context = _run_context(run.term, None, ledger.lock.leadership(term=run.term))
        context.run(_RUN.set, run)
        try:
            result = context.run(job.func, *job.args, **job.kwargs)
        except Exception as exc:
            self._record(run, exc)
            raise
        self._record(run, None)
        return result

    async def _run_async(self) -> Any:
        due = self._next()
        if due is None:
            return None
        ledger, spec, job = self._ledger, self._spec, self._job
        assert spec is not None  # a refused job has no run times
        try:
            run = await ledger.acall(
                lambda: ledger.schedule.claim(spec, _slot(due.at), rerun=due.rerun)
            )
        except _NOT_CLAIMED as exc:
            self._not_claimed(due, exc)
            return None
        self._claimed(run, due)
        if run is None:
            return None
        context = _run_context(run.term, None, ledger.lock.leadership(term=run.term))
        context.run(_RUN.set, run)
        task = asyncio.get_running_loop().create_task(
            job.func(*job.args, **job.kwargs), context=context
        )
        try:
            result = await task
        except asyncio.CancelledError:
            task.cancel()
            raise  # the slot stays running: the next leader's ``interrupted`` policy
        except Exception as exc:
            await self._arecord(run, exc)
            raise
        await self._arecord(run, None)
        return result

    def _record(self, run: Run, error: Exception | None) -> None:
        """Record how the run ended (from a job's thread)."""
        finish = functools.partial(self._ledger.schedule.finish, run, error=error)
        try:
            self._ledger.call(finish)
        except _NOT_CLAIMED as exc:
            self._unrecorded(exc)

    async def _arecord(self, run: Run, error: Exception | None) -> None:
        """Record how the run ended (from a job's coroutine)."""
        finish = functools.partial(self._ledger.schedule.finish, run, error=error)
        try:
            await self._ledger.acall(finish)
        except _NOT_CLAIMED as exc:
            self._unrecorded(exc)

    def _unrecorded(self, exc: Exception) -> None:
        log.warning("run_unrecorded", job=self.id, lock=self._ledger.lock.label,
                    reason="leadership lost before the run ended: its slot stays running, "
                    "for the next leader's interrupted policy", detail=str(exc))  # fmt: skip


# ---------------------------------------------------------------------- bind_scheduler


class SchedulerBinding:
    """Keeps a scheduler paused while the lock is not LEADER, running while it is, and
    (ledger mode) claims each run's slot in the ledger before it runs.

    Made by [`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler]; see
    there. [`sync`][pgleaderlock.integrations.apscheduler.SchedulerBinding.sync] is safe
    from any thread.
    """

    def __init__(
        self,
        scheduler: Any,
        lock: Leadership,
        *,
        ledger: bool = True,
        catch_up: CatchUp = "latest",
        max_catch_up: int = 100,
        interrupted: Interrupted = "lost",
        catch_up_s: float = 0.0,
    ) -> None:
        catch_up_s = not_negative("catch_up_s", catch_up_s)
        if not callable(getattr(scheduler, "pause", None)) or not hasattr(scheduler, "state"):
            raise ConfigurationError(f"expected an APScheduler 3.x scheduler, got {scheduler!r}")
        self._scheduler = scheduler
        self._lock = _lock_of(lock)
        self._ledger: _SlotLedger | None = None
        if ledger:
            if catch_up_s:
                raise ConfigurationError(
                    "catch_up_s belongs to bind_scheduler(..., ledger=False); the ledger "
                    "mode catches up by catch_up= and each job's misfire_grace_time"
                )
            check_policy(catch_up, interrupted, max_catch_up)
            if lock_settings(self._lock).term_table is None:
                raise ConfigurationError(
                    "bind_scheduler claims every run in the ledger under the lock's fencing "
                    "term: it needs LeaderLock(..., fencing=True). To bind without the "
                    "ledger (a run time that falls due during a fail-over may be missed), "
                    "pass ledger=False"
                )
            threaded = lock if isinstance(lock, ThreadedLeaderLock) else None
            policy = _Policy(catch_up, max_catch_up, interrupted)
            self._ledger = _SlotLedger(self._lock, threaded, policy)
        self._catch_up = dt.timedelta(seconds=catch_up_s)
        self._mutex = threading.RLock()  # scheduler listeners may call sync() again
        self._closed = False
        self._term: int | None = None
        self._settling: set[concurrent.futures.Future[None]] = set()
        self._plugin = follow_state(self._lock, self._on_state_change)
        scheduler.add_listener(self._on_scheduler_event, _BINDING_EVENTS)
        self._wrap_executors()
        self.sync()

    @property
    def scheduler(self) -> Any:
        """The bound scheduler."""
        return self._scheduler

    @property
    def ledger(self) -> bool:
        """True in ledger mode: every run's slot is claimed in the ledger first."""
        return self._ledger is not None

    @property
    def schedule(self) -> Scheduler | None:
        """In ledger mode: the [`Scheduler`][pgleaderlock.schedule.Scheduler] whose
        ledger the runs are claimed in (a job's rows are named ``<lock>:<job id>``);
        ``None`` with ``ledger=False``."""
        return None if self._ledger is None else self._ledger.schedule

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
        (ledger mode) call [`current_run`][pgleaderlock.integrations.apscheduler.current_run]
        or [`current_term`][pgleaderlock.integrations.apscheduler.current_term], which
        are fixed per run.
        """
        return self._term if self.active else None

    def close(self) -> None:
        """Stop following the lock; the scheduler stays as it is (its runs are no longer
        claimed in the ledger)."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        if self._lock.plugins.is_registered(self._plugin):
            self._lock.plugins.unregister(self._plugin)
        self._scheduler.remove_listener(self._on_scheduler_event)
        for future in list(self._settling):
            future.cancel()

    def _on_state_change(self, old: LockState, new: LockState) -> None:
        if self._ledger is not None:
            self._ledger.loop = asyncio.get_running_loop()
        if LockState.LEADER in (old, new):
            self.sync()

    def _on_scheduler_event(self, event: Any) -> None:
        self._wrap_executors()
        if event.code == EVENT_SCHEDULER_STARTED:
            self.sync()

    def _wrap_executors(self) -> None:
        """In ledger mode, have each of the scheduler's executors submit every job
        through the ledger (idempotent; executors are added at start-up or later)."""
        if self._ledger is None:
            return
        with self._scheduler._executors_lock:
            executors = list(self._scheduler._executors.values())
        for executor in executors:
            if getattr(executor, "_pgleaderlock_binding", None) is self:
                continue
            submit = type(executor).submit_job.__get__(executor)

            def submit_job(job: Any, run_times: list[dt.datetime], submit: Any = submit) -> Any:
                return submit(*self._through_ledger(job, run_times))

            executor.submit_job = submit_job
            executor._pgleaderlock_binding = self

    def _through_ledger(self, job: Any, run_times: list[dt.datetime]) -> tuple[Any, Any]:
        ledger = self._ledger
        if ledger is None or self._closed:
            return job, run_times
        spec = ledger.job(job)
        if spec is None:  # refused (logged): nothing runs
            return _SlotJob(job, None, [], ledger), []
        due = [_Due(at) for at in run_times]
        return _SlotJob(job, spec, due, ledger), run_times

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
                        jobs = scheduler.get_jobs()
                        cutoff = self._skip_followers_runs(jobs)
                        scheduler.resume()
                        log.info("scheduler_resumed", lock=self._lock.label)
                        if self._ledger is not None and term is not None:
                            self._settle_later(jobs, cutoff)
                elif scheduler.state == STATE_RUNNING:
                    scheduler.pause()
                    log.info("scheduler_paused", lock=self._lock.label)
            except SchedulerNotRunningError:
                pass  # shut down meanwhile: nothing to pause or resume

    def _skip_followers_runs(self, jobs: list[Any]) -> dt.datetime:
        """Move every job whose next run time lies before the hand-over to its first
        fire time at or after it (or remove it if it has none, like a past date job).
        Returns the hand-over time (the cutoff)."""
        now = dt.datetime.now(getattr(self._scheduler, "timezone", None) or dt.UTC)
        cutoff = now - self._catch_up
        for job in jobs:
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
        return cutoff

    def _settle_later(self, jobs: list[Any], cutoff: dt.datetime) -> None:
        """On the lock's loop: settle each job's past in the ledger (interrupted and
        missed slots), then submit the run times to run now."""
        assert self._ledger is not None
        loop = self._ledger.lock_loop()
        if loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._settle(jobs, cutoff), loop)
        self._settling.add(future)
        future.add_done_callback(self._settling.discard)

    async def _settle(self, jobs: list[Any], cutoff: dt.datetime) -> None:
        ledger = self._ledger
        assert ledger is not None
        for job in jobs:
            spec = ledger.job(job)
            if spec is None:
                continue
            try:
                todo = await ledger.schedule.settle(spec, cutoff)
            except _NOT_CLAIMED as exc:
                log.info("catch_up_stopped", job=job.id, lock=self._lock.label,
                         reason="leadership lost", detail=str(exc))  # fmt: skip
                return
            except Exception as exc:  # a refused table, ...: this job's catch-up only
                log.error("catch_up_failed", job=job.id, lock=self._lock.label, exc=exc)
                continue
            if not todo:
                continue
            grace = dt.timedelta(seconds=spec.misfire_grace_s)
            now = dt.datetime.now(dt.UTC)
            due = [
                _Due(slot, forced=rerun or now - slot > grace, rerun=rerun) for slot, rerun in todo
            ]
            if job.coalesce:  # as APScheduler rolls missed run times into one
                fresh = [d for d in due if not d.forced]
                due = [d for d in due if d.forced] + fresh[-1:]
            self._submit(job, spec, due)

    def _submit(self, job: Any, spec: Job, due: list[_Due]) -> None:
        assert self._ledger is not None
        try:
            executor = self._scheduler._lookup_executor(job.executor)
            submit = type(executor).submit_job.__get__(executor)
            submit(_SlotJob(job, spec, due, self._ledger), [d.at for d in due])
        except Exception as exc:  # MaxInstancesReachedError, a removed executor, ...
            log.warning("catch_up_skipped", job=job.id, lock=self._lock.label,
                        run_times=[d.at.isoformat() for d in due],
                        reason=f"{type(exc).__name__}: {exc}")  # fmt: skip
        else:
            log.info("catch_up_submitted", job=job.id, lock=self._lock.label,
                     run_times=[d.at.isoformat() for d in due])  # fmt: skip


_BINDING_EVENTS = EVENT_SCHEDULER_STARTED | EVENT_EXECUTOR_ADDED


def bind_scheduler(
    scheduler: Any,
    lock: Leadership,
    *,
    ledger: bool = True,
    catch_up: CatchUp = "latest",
    max_catch_up: int = 100,
    interrupted: Interrupted = "lost",
    catch_up_s: float = 0.0,
) -> SchedulerBinding:
    """Run ``scheduler``'s jobs only on the leader, each run time at most once across
    the replicas: paused on followers, resumed on the leader, and every run's slot
    claimed in the ledger before it runs.

    Call it before or after ``scheduler.start()``: a scheduler that starts while the lock
    is not LEADER is paused before it processes any job (and a lock that is never
    started keeps it paused). The binding owns ``pause()``/``resume()`` from then on.

    **Ledger mode** (the default; needs ``LeaderLock(..., fencing=True)``): each run
    time APScheduler submits is a slot of the job (keyed ``<lock>:<job id>``, the run
    time rounded to the millisecond) in the ledger of
    [`pgleaderlock.schedule`][pgleaderlock.schedule], claimed under the lock's fencing
    term on the session that holds the lock before the job runs, so no slot runs twice
    across the fleet, whatever the timing of a fail-over. When the lock becomes LEADER,
    the slots that fell due while nobody ran them are settled: those within the job's
    ``misfire_grace_time`` run now (late); older ones follow ``catch_up``; a slot whose
    leader died mid-run follows ``interrupted``. Give every job an explicit ``id`` and
    fixed run times (cron, date, or interval with a fixed ``start_date``): every replica
    must name the same slots. Triggers with ``jitter`` are refused (``job_refused``).
    Jobs must run in this process (the asyncio and thread pool executors).

    When the lock leaves LEADER the scheduler is paused at once: no new run starts. A run
    already in progress is not interrupted (APScheduler cannot cancel one); decorate
    coroutine jobs with [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only]
    too if they must stop at once. In ledger mode its slot stays ``running``, for the
    next leader's ``interrupted`` policy.

    **``ledger=False``** keeps the earlier behaviour: when the lock becomes LEADER, every
    job whose next run time has already passed (minus ``catch_up_s``) is moved to its
    first fire time at or after now, so a run time that falls due during the hand-over
    is missed (or, with ``catch_up_s``, may run on both the old and the new leader).

    Args:
        scheduler: an APScheduler 3.x scheduler (``AsyncIOScheduler`` with a lock on the
            same loop, ``BackgroundScheduler`` with a
            [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock], ...).
        lock: the lock, or a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock].
        ledger: claim every run in the ledger (default). ``False``: the earlier
            behaviour, without the ledger (and without the need for fencing).
        catch_up: ledger mode, the slots that fell due while nobody led, later than the
            job's ``misfire_grace_time`` when a leader looks (see
            [`CatchUp`][pgleaderlock.schedule.CatchUp]): ``"latest"`` (default) runs the
            newest of them, ``"all"`` runs them all (at most ``max_catch_up``),
            ``"none"`` records them as missed.
        max_catch_up: with ``catch_up="all"``, at most this many run.
        interrupted: ledger mode, a slot whose leader ended mid-run (see
            [`Interrupted`][pgleaderlock.schedule.Interrupted]): ``"lost"`` (default)
            records it, ``"rerun"`` runs it again.
        catch_up_s: with ``ledger=False`` only: run times up to this many seconds before
            the hand-over are left to APScheduler's misfire handling instead of being
            skipped, at the price that such a run may execute on both the old and the new
            leader.

    Returns:
        The binding (keep it to
        [`close`][pgleaderlock.integrations.apscheduler.SchedulerBinding.close] it).

    Raises:
        ConfigurationError: ledger mode on a lock without fencing, or bad arguments.
    """
    return SchedulerBinding(
        scheduler,
        lock,
        ledger=ledger,
        catch_up=catch_up,
        max_catch_up=max_catch_up,
        interrupted=interrupted,
        catch_up_s=catch_up_s,
    )
