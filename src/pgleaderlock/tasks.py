"""Leader-only coroutines for any asyncio program (no extra needed).

[`LeaderTasks`][pgleaderlock.LeaderTasks] runs registered coroutine functions only while a
[`LeaderLock`][pgleaderlock.LeaderLock] is LEADER. They stop the moment the lock leaves
LEADER (to RECONNECTING, FOLLOWER, RELEASING or STOPPED), because exclusivity is no longer
guaranteed then, and start again from the beginning when it is LEADER again. The FastAPI
integration is built on it; [`follow_state`][pgleaderlock.tasks.follow_state] is the hook
that the framework integrations and [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock]
share.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from .core._logging import get_logger
from .core.errors import ConfigurationError
from .core.hooks import callback_plugin, hookimpl
from .core.lock import LeaderLock
from .core.models import Event, LockState, RetryContext
from .core.retry import RetryStrategy, ask, check_retry_strategy

__all__ = ["LeaderTasks", "TaskFunction", "follow_state", "next_delay", "supervise"]

log = get_logger("pgleaderlock.tasks")

TaskFunction = Callable[[], Awaitable[object]]
"""A leader-only task: a coroutine function without arguments."""

TF = TypeVar("TF", bound=TaskFunction)

HEALTHY_RUN_S = 60.0
"""A run that lasted this long before crashing starts a fresh retry cycle (attempt 1)."""


@dataclass(frozen=True)
class _TaskSpec:
    name: str
    fn: TaskFunction


StateListener = Callable[[LockState, LockState], object]


class _StatePlugin:
    def __init__(self, fn: StateListener) -> None:
        self._fn = fn


class _FirstStatePlugin(_StatePlugin):
    """Runs before every ordinary callback and plugin of the lock (``tryfirst``)."""

    @hookimpl(tryfirst=True)
    def pgleaderlock_state_change(self, old: LockState, new: LockState) -> object:
        return self._fn(old, new)


class _OrderedStatePlugin(_StatePlugin):
    """Runs in registration order among the lock's callbacks and plugins."""

    @hookimpl
    def pgleaderlock_state_change(self, old: LockState, new: LockState) -> object:
        return self._fn(old, new)


def follow_state(lock: LeaderLock, fn: StateListener, *, first: bool = True) -> object:
    """Register ``fn(old, new)`` for every state change of ``lock``, as a plugin.

    With ``first`` it runs before the lock's ordinary callbacks and plugins, so that
    leader-only work has stopped before they (or an unlock) run. ``fn`` may be a
    coroutine function; it runs on the lock's lifecycle task.

    Returns:
        The plugin; ``lock.plugins.unregister(plugin)`` detaches it.
    """
    plugin = _FirstStatePlugin(fn) if first else _OrderedStatePlugin(fn)
    lock.plugins.register(plugin)
    return plugin


class LeaderTasks:
    """Coroutines that run only while ``lock`` is LEADER.

    Every registered task is started (as an asyncio task of its own) when the lock
    becomes LEADER, and cancelled *and awaited* as soon as it leaves LEADER: on loss
    (including RECONNECTING, where ``is_leader`` is already False), on ``step_down()``
    and on ``shutdown()``. The cancellation happens inside the lock's own
    state-change hook, which runs before any other callback or plugin of the lock
    (``tryfirst``): on a voluntary release the tasks have stopped *before*
    ``pg_advisory_unlock`` runs, and no task ever runs while the lock is not LEADER.
    When the lock is LEADER again, the tasks start again from the beginning.

    A task that raises is logged and restarted after the delay its retry strategy gives
    (the lock's own strategy by default); leadership is not affected, unless
    ``give_away_after_crashes`` is set: after that many crashes of one task in a row,
    this replica gives its leadership away (see below). A task that returns normally has
    finished for this leadership term and is started again at the next one. A task that
    ignores cancellation for longer than ``cancel_timeout_s`` is logged as an error and
    is not started again until it has ended.

    **Draining.** With the lock's ``drain_s`` > 0, a graceful stop (``step_down()``,
    ``shutdown()``) first lets the running tasks finish their current unit of work: the
    lock stays LEADER (and keeps probing) while
    [`draining`][pgleaderlock.LeaderTasks.draining] is True, until every task has
    returned or ``drain_s`` has passed; the tasks still running then are cancelled, and
    the lock is released. A crashed task is not restarted during a drain.

    **Giving leadership away.** A task that crashes on one replica only (a bad local
    disk, a missing dependency, a corrupt cache) keeps the work from being done while
    that replica leads. With ``give_away_after_crashes=N``, once a task has crashed
    ``N`` times in a row (or its retry strategy gave it up), this replica shuts its
    lock down, which stops every task and releases the lock, so that a healthy replica
    takes over at once, and starts the lock again after ``give_away_cooldown_s``.
    Meanwhile [`paused_until`][pgleaderlock.LeaderTasks.paused_until] says until when
    (the lock's state is ``STOPPED``). A single replica gives leadership away too: the
    tasks then run nowhere during the cool-down. [`stop`][pgleaderlock.LeaderTasks.stop]
    and [`close`][pgleaderlock.LeaderTasks.close] end a cool-down without restarting the
    lock; a lock shut down by other code during a cool-down is started again at its end.

    Create the ``LeaderTasks`` before starting the lock (tasks follow the state changes
    it sees). [`close`][pgleaderlock.LeaderTasks.close] detaches it from the lock.

    Args:
        lock: the lock whose leadership the tasks follow.
        retry_strategy: delays between restarts of a crashed task; default: the lock's
            retry strategy. ``None`` from the strategy gives that task up until the next
            leadership term.
        cancel_timeout_s: how long to wait for a cancelled task to end before going on
            without it. The lock's lifecycle task waits this long at most (it does not
            probe or unlock meanwhile).
        give_away_after_crashes: after this many crashes in a row of one task, release
            the lock for another replica and stay out of the election for
            ``give_away_cooldown_s``; ``None`` (default): never, the task is restarted.
        give_away_cooldown_s: how long a replica that gave its leadership away stays
            out of the election.

    Raises:
        ConfigurationError: bad arguments.

    Example:

    ```python
    lock = LeaderLock.from_name("reports", dsn=DSN)
    tasks = LeaderTasks(lock)

    @tasks.task
    async def refresh() -> None:
        while True:
            await rebuild_report()
            await asyncio.sleep(60)

    async with lock:
        ...  # refresh() runs on whichever process leads
        await tasks.end_cooldown()  # with give_away_after_crashes: before the lock stops
    await tasks.stop()
    ```
    """

    def __init__(
        self,
        lock: LeaderLock,
        *,
        retry_strategy: RetryStrategy | None = None,
        cancel_timeout_s: float = 10.0,
        give_away_after_crashes: int | None = None,
        give_away_cooldown_s: float = 60.0,
    ) -> None:
        if not isinstance(lock, LeaderLock):
            raise ConfigurationError(f"LeaderTasks needs a LeaderLock, got {lock!r}")
        check_retry_strategy(retry_strategy)
        _positive("cancel_timeout_s", cancel_timeout_s)
        self._lock = lock
        self._retry: RetryStrategy = retry_strategy or lock.retry_strategy
        self._cancel_timeout_s = float(cancel_timeout_s)
        self._give_away_after = check_give_away(give_away_after_crashes)
        self._cooldown_s = _positive("give_away_cooldown_s", give_away_cooldown_s)
        self._cooldown: asyncio.Task[None] | None = None  # giving leadership away
        self._paused_until: float | None = None
        self._specs: dict[str, _TaskSpec] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled, not yet ended
        self._stragglers: dict[str, asyncio.Task[None]] = {}  # outlived cancel_timeout_s
        self._leading = False
        self._plugin: object | None = follow_state(lock, self._on_state_change)
        self._drain_plugin: object | None = callback_plugin(Event.DRAINING, self._drain)
        lock.plugins.register(self._drain_plugin)

    # ------------------------------------------------------------------ registration

    @property
    def lock(self) -> LeaderLock:
        """The lock these tasks follow."""
        return self._lock

    @property
    def names(self) -> list[str]:
        """Names of all registered tasks, in registration order."""
        return list(self._specs)

    @property
    def running(self) -> list[str]:
        """Names of the tasks running in this process now (empty unless LEADER)."""
        return [name for name, task in self._running.items() if not task.done()]

    @property
    def draining(self) -> bool:
        """True while the lock's graceful stop lets the tasks finish their current unit
        of work (the lock's ``drain_s``): a task that loops checks it between units and
        returns. Tasks still running when ``drain_s`` ends are cancelled as usual."""
        return self._lock.draining

    @property
    def paused_until(self) -> float | None:
        """While this replica stays out of the election after giving its leadership
        away (``give_away_after_crashes``): when it competes again, as a UNIX time;
        otherwise ``None``."""
        return self._paused_until

    def add(self, fn: TaskFunction, *, name: str | None = None) -> None:
        """Register a leader-only task.

        Args:
            fn: a coroutine function without arguments.
            name: a unique name for logs and [`running`][pgleaderlock.LeaderTasks.running];
                default: the function's ``__name__``.

        Raises:
            ConfigurationError: ``fn`` is not a coroutine function, or the name is
                already taken.
        """
        if not inspect.iscoroutinefunction(fn):
            raise ConfigurationError(
                f"a leader task must be a coroutine function (async def), got {fn!r}"
            )
        task_name = name if name is not None else getattr(fn, "__name__", repr(fn))
        if task_name in self._specs:
            raise ConfigurationError(f"a leader task named {task_name!r} is already registered")
        spec = _TaskSpec(task_name, fn)
        self._specs[task_name] = spec
        if self._leading and self._lock.is_leader:
            self._start(spec)

    @overload
    def task(self, fn: TF, /) -> TF: ...

    @overload
    def task(self, fn: None = None, /, *, name: str | None = None) -> Callable[[TF], TF]: ...

    def task(self, fn: TaskFunction | None = None, /, *, name: str | None = None) -> Any:
        """Decorator form of [`add`][pgleaderlock.LeaderTasks.add]: ``@tasks.task`` or
        ``@tasks.task(name="x")``."""

        def register(func: TaskFunction) -> TaskFunction:
            self.add(func, name=name)
            return func

        return register(fn) if fn is not None else register

    # ------------------------------------------------------------------ lifecycle

    async def stop(self) -> None:
        """Cancel and await every task of this object, including any that outlived an
        earlier cancellation. Call it after the lock has been shut down.

        Tasks start again at the lock's next LEADER state. A task that still has not
        ended after ``cancel_timeout_s`` is logged as an error and left behind.
        """
        self._leading = False
        await self.end_cooldown()
        tasks = {*self._running.values(), *self._stopping, *self._stragglers.values()}
        self._running.clear()
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self._cancel_timeout_s)
        for task in tasks - pending:
            self._consume(task)
        for task in pending:
            log.error(
                "leader_task_ignores_cancel",
                task=task.get_name(),
                lock=self._lock.label,
                timeout_s=self._cancel_timeout_s,
            )

    async def end_cooldown(self) -> None:
        """Cancel a give-away's cool-down, so that it does not start the lock again: call
        it before shutting the lock down for good ([`stop`][pgleaderlock.LeaderTasks.stop]
        does it too, but after the lock's shutdown a cool-down could have restarted it)."""
        cooldown, self._cooldown = self._cooldown, None
        if cooldown is not None and cooldown is not asyncio.current_task():
            cooldown.cancel()
            await asyncio.gather(cooldown, return_exceptions=True)
        self._paused_until = None

    async def close(self) -> None:
        """Detach from the lock and [`stop`][pgleaderlock.LeaderTasks.stop] every task;
        tasks never start again."""
        for plugin in (self._plugin, self._drain_plugin):
            if plugin is not None and self._lock.plugins.is_registered(plugin):
                self._lock.plugins.unregister(plugin)
        self._plugin = self._drain_plugin = None
        await self.stop()

    async def _on_state_change(self, old: LockState, new: LockState) -> None:
        if self._plugin is None:
            return
        if new is LockState.LEADER:
            self._leading = True
            for spec in list(self._specs.values()):
                self._start(spec)
        elif old is LockState.LEADER:
            self._leading = False
            await self._stop_running(new)

    async def _drain(self) -> None:
        """The lock drains (a graceful stop, ``drain_s``): wait for the running tasks to
        return by themselves (they see ``draining``). The lock cancels this wait when
        ``drain_s`` is over; leaving LEADER then cancels the tasks still running."""
        running = {name: task for name, task in self._running.items() if not task.done()}
        if running:
            log.info("leader_tasks_draining", lock=self._lock.label, tasks=",".join(running))
            await asyncio.wait(running.values())

    def _start(self, spec: _TaskSpec) -> None:
        current = self._running.get(spec.name)
        if current is not None and not current.done():
            return
        straggler = self._stragglers.get(spec.name)
        if straggler is not None and not straggler.done():
            log.error(
                "leader_task_not_started",
                task=spec.name,
                lock=self._lock.label,
                reason="its previous run has not ended after cancellation",
            )
            return
        task = asyncio.get_running_loop().create_task(
            self._supervise(spec), name=f"pgleaderlock-task:{spec.name}"
        )
        self._running[spec.name] = task

    async def _stop_running(self, new: LockState) -> None:
        running, self._running = self._running, {}
        if not running:
            return
        for task in running.values():
            task.cancel()
            self._track_stopping(task)
        _, pending = await asyncio.wait(running.values(), timeout=self._cancel_timeout_s)
        for name, task in running.items():
            if task in pending:
                log.error(
                    "leader_task_ignores_cancel",
                    task=name,
                    lock=self._lock.label,
                    timeout_s=self._cancel_timeout_s,
                )
                self._stragglers[name] = task
            else:
                self._consume(task)
        log.info(
            "leader_tasks_stopped",
            lock=self._lock.label,
            state=new,
            tasks=",".join(running),
        )

    def _track_stopping(self, task: asyncio.Task[None]) -> None:
        self._stopping.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._stopping.discard(task)
        for name, straggler in list(self._stragglers.items()):
            if straggler is task:
                del self._stragglers[name]
        self._consume(task)

    def _consume(self, task: asyncio.Task[None]) -> None:
        """Retrieve a finished task's outcome, so asyncio never reports it as lost."""
        if task.done() and not task.cancelled():
            exc = task.exception()
            if exc is not None:
                log.error(
                    "leader_task_failed",
                    task=task.get_name(),
                    lock=self._lock.label,
                    error=repr(exc),
                )

    # ------------------------------------------------------------------ one task

    async def _supervise(self, spec: _TaskSpec) -> None:
        finished = await supervise(
            spec.fn,
            task=spec.name,
            lock=self._lock.label,
            retry=self._retry,
            give_up_after=self._give_away_after,
            until=lambda: self._lock.draining,
        )
        if not finished and self._give_away_after is not None and self._cooldown is None:
            # A task of its own: giving away stops every leader task, this one included.
            self._cooldown = asyncio.get_running_loop().create_task(
                self._give_away(spec.name), name=f"pgleaderlock-give-away:{self._lock.label}"
            )

    async def _give_away(self, task: str) -> None:
        """Release the lock for another replica, stay out of the election for the
        cool-down, then compete again."""
        lock = self._lock
        try:
            if not lock.is_leader:
                return  # lost meanwhile: nothing to give
            self._paused_until = time.time() + self._cooldown_s
            log.warning(
                "leadership_given_away",
                task=task,
                lock=lock.label,
                crashes=self._give_away_after,
                cooldown_s=self._cooldown_s,
            )
            await lock.shutdown()  # stops every leader task, then releases the lock
            await asyncio.sleep(self._cooldown_s)
            self._paused_until = None
            log.info("leadership_competing_again", lock=lock.label)
            await lock.start()
        except Exception as exc:  # nobody awaits this task: say why the lock stays out
            log.error("give_away_failed", lock=lock.label, error=repr(exc), exc_info=True)
        finally:
            self._paused_until = None
            if self._cooldown is asyncio.current_task():
                self._cooldown = None


def _positive(what: str, value: object) -> float:
    if isinstance(value, bool) or not (
        isinstance(value, int | float) and value > 0 and math.isfinite(value)
    ):
        raise ConfigurationError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def check_give_away(value: object) -> int | None:
    """``give_away_after_crashes``: a positive int or ``None``.

    Raises:
        ConfigurationError: anything else.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(
            f"give_away_after_crashes must be a positive int or None, got {value!r}"
        )
    return value


def next_delay(retry: RetryStrategy, ctx: RetryContext, lock: str) -> float | None:
    """Ask ``retry`` for a delay; a strategy that raises gives up, like one returning
    None."""
    try:
        return ask(retry, ctx)
    except Exception as exc:
        log.error("retry_strategy_failed", lock=lock, error=repr(exc), exc_info=True)
        return None


async def supervise(
    run: TaskFunction,
    *,
    task: str,
    lock: str,
    retry: RetryStrategy,
    give_up_after: int | None = None,
    until: Callable[[], bool] | None = None,
) -> bool:
    """Run ``run()`` until it returns; restart it after a crash with ``retry``'s delays.

    A run that returns normally has finished for this leadership term. A run that
    lasted [`HEALTHY_RUN_S`][pgleaderlock.tasks.HEALTHY_RUN_S] before crashing starts a
    fresh retry cycle.

    Args:
        run: the task's coroutine function.
        task: its name, for logs.
        lock: the label of the lock (or name) it serves, for logs.
        retry: delays between restarts; ``None`` from it gives up.
        give_up_after: give up after this many crashes in a row (``None``: never).
        until: not restarted once this returns True (a drain: the task is done for
            this term).

    Returns:
        True if the task finished, False if it was given up.
    """
    attempt = 0
    cycle_start = time.monotonic()
    while True:
        log.info("leader_task_started", task=task, lock=lock, attempt=attempt + 1)
        run_start = time.monotonic()
        try:
            await run()
        except Exception as exc:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise asyncio.CancelledError from exc  # it swallowed our cancel
            now = time.monotonic()
            if now - run_start >= HEALTHY_RUN_S:
                attempt, cycle_start = 0, run_start
            attempt += 1
            delay = next_delay(retry, RetryContext(attempt, now - cycle_start, exc), lock)
            if give_up_after is not None and attempt >= give_up_after:
                delay = None
            log.error(
                "leader_task_crashed",
                task=task,
                lock=lock,
                attempt=attempt,
                error=repr(exc),
                restart_in_s=None if delay is None else round(delay, 3),
                exc_info=True,
            )
            if delay is None:
                log.error("leader_task_gave_up", task=task, lock=lock, attempt=attempt)
                return False
            await asyncio.sleep(delay)
            if until is not None and until():
                return True  # draining: no new run
        else:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise asyncio.CancelledError  # it swallowed our cancel and returned
            log.info("leader_task_finished", task=task, lock=lock)
            return True
