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
import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from .lowlevel import (
    ConfigurationError,
    Event,
    LeaderLock,
    Leadership,
    LockState,
    RetryStrategy,
    Supervisor,
    callback_plugin,
    check_give_away,
    check_retry_strategy,
    follow_state,
    get_logger,
    positive,
)

__all__ = ["LeaderTasks", "TaskFunction", "follow_state"]

log = get_logger("pgleaderlock.tasks")

TaskFunction = Callable[[], Awaitable[object]]
"""A leader-only task: a coroutine function without arguments."""

TF = TypeVar("TF", bound=TaskFunction)


class LeaderTasks:
    """Coroutines that run only while ``lock`` is LEADER.

    Every registered task is started (as an asyncio task of its own) when the lock
    becomes LEADER, and cancelled *and awaited* as soon as it leaves LEADER: on loss
    (including RECONNECTING, where ``is_leader`` is already False), on ``step_down()``
    and on ``shutdown()``. Every task is cancelled the moment the lock leaves LEADER,
    before any callback or plugin of the lock runs (the tasks of every ``LeaderTasks``
    of the lock at once), and awaited in the lock's own state-change hook, which runs
    before the other callbacks and plugins (``tryfirst``): on a voluntary release the
    tasks have stopped *before* ``pg_advisory_unlock`` runs, and no task ever runs
    while the lock is not LEADER. (A task's calls on the lock's session that have not
    run fail then too, so that no stop waits for the session it is stopping.)
    When the lock is LEADER again, the tasks start again from the beginning.

    With ``fencing=True`` each task runs bound to the leadership it was started under
    (a [`Leadership`][pgleaderlock.Leadership]): ``lock.fence(conn)`` in it, and in
    the tasks and threads it starts, fences with that term, and is refused once that
    leadership has ended, even if the lock leads again by then (a unit of work finished
    inside ``asyncio.shield``, or after swallowing its cancellation).

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

    A ``LeaderTasks`` may be made before the lock starts or while it runs: made while
    the lock leads, its tasks start as they are added.
    [`close`][pgleaderlock.LeaderTasks.close] detaches it from the lock.

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
        self._lock = lock
        self._give_away_after = check_give_away(give_away_after_crashes)
        self._cooldown_s = positive("give_away_cooldown_s", give_away_cooldown_s)
        self._cooldown: asyncio.Task[None] | None = None  # giving leadership away
        self._paused_until: float | None = None
        self._functions: dict[str, TaskFunction] = {}
        self._tasks = Supervisor(
            kind="leader_task",
            label=lock.label,
            retry=retry_strategy or lock.retry_strategy,
            give_up_after=self._give_away_after,
            gave_up=self._gave_up,
            cancel_timeout_s=positive("cancel_timeout_s", cancel_timeout_s),
        )
        # Made while the lock leads already: the tasks start as they are added.
        self._leading = lock.is_leader
        self._plugin: object | None = follow_state(
            lock, self._on_state_change, leaving=self._leaving
        )
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
        return list(self._functions)

    @property
    def running(self) -> list[str]:
        """Names of the tasks running in this process now (empty unless LEADER)."""
        return [name for name in self._functions if self._tasks.runs(name)]

    @property
    def draining(self) -> bool:
        """True while the lock's graceful stop lets the tasks finish their current unit
        of work (the lock's ``drain_s``): a task that loops checks it between units and
        returns. Tasks still running when ``drain_s`` ends are cancelled as usual."""
        return self._lock.draining

    async def idle(self, seconds: float) -> None:
        """Sleep ``seconds`` between units of work, in a task of this object: a graceful
        stop's drain waits only for the tasks that run a unit of work. A task that sleeps
        here when the drain starts is ended at once (cancelled: the ``CancelledError``
        comes out of this call), and one that comes here during the drain ends here; so
        a stop with nothing running returns at once, whatever ``drain_s`` is. Outside a
        task of this object it is ``asyncio.sleep``.

        ```python
        @tasks.task
        async def refresh() -> None:
            while True:
                await rebuild_report()  # a drain lets this finish (up to drain_s)
                await tasks.idle(60)  # ... and does not wait for this
        ```
        """
        await self._tasks.idle(seconds)

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
        if task_name in self._functions:
            raise ConfigurationError(f"a leader task named {task_name!r} is already registered")
        self._functions[task_name] = fn
        if self._leading and self._lock.is_leader:
            self._start(task_name)

    async def remove(self, name: str) -> None:
        """Unregister the task called ``name``; if it runs, cancel and await it."""
        if self._functions.pop(name, None) is not None:
            await self._tasks.stop([name])

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
        await self._tasks.stop_all()

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
            for name in list(self._functions):
                self._start(name)
        elif old is LockState.LEADER:
            self._leading = False
            stopped = await self._tasks.stop()
            if stopped:
                log.info("leader_tasks_stopped", lock=self._lock.label, state=new,
                         tasks=",".join(stopped))  # fmt: skip

    def _leaving(self) -> None:
        """The lock leaves LEADER: cancel every task now, before any listener of the
        lock runs (``_on_state_change`` then awaits them), so that no task of this
        object runs on while another listener awaits its own work."""
        self._leading = False
        self._tasks.cancel()

    async def _drain(self) -> None:
        """The lock drains (a graceful stop, ``drain_s``): wait for the running tasks to
        return by themselves (they see ``draining``). The lock cancels this wait when
        ``drain_s`` is over; leaving LEADER then cancels the tasks still running."""
        await self._tasks.drain()

    def _start(self, name: str) -> None:
        fn = self._functions[name]
        term = self._lock.term  # the leadership it starts under (None without fencing)
        if term is not None:
            fn = functools.partial(_under, self._lock.leadership(term=term), fn)
        self._tasks.start(name, fn, until=lambda: self._lock.draining)

    def _gave_up(self, task: str) -> None:
        """A task crashed too often: with ``give_away_after_crashes``, give the
        leadership away, in a task of its own (giving away stops every leader task, the
        one that calls this included)."""
        if self._give_away_after is not None and self._cooldown is None:
            self._cooldown = asyncio.get_running_loop().create_task(
                self._give_away(task), name=f"pgleaderlock-give-away:{self._lock.label}"
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


async def _under(leadership: Leadership, fn: TaskFunction) -> object:
    """Run ``fn()`` bound to the leadership it was started under: its fences (and those
    of the tasks and threads it starts) are refused once that leadership has ended."""
    with leadership:
        return await fn()
