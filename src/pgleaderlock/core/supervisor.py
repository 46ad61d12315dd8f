"""Leader-only work, supervised: named tasks started while something is led, restarted
after a crash with the retry strategy's delays, drained, and cancelled *and awaited*
within a bound when the leadership ends.

One [`Supervisor`][pgleaderlock.core.supervisor.Supervisor] serves both
[`LeaderTasks`][pgleaderlock.LeaderTasks] (a lock's tasks) and the Coordinator's workers
(a task per name): what starts and stops them differs, how they run does not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ._logging import get_logger
from .errors import ConfigurationError
from .models import RetryContext
from .retry import RetryStrategy, delay_or_give_up

__all__ = ["HEALTHY_RUN_S", "Supervisor", "check_give_away", "supervise"]

log = get_logger("pgleaderlock.tasks")

HEALTHY_RUN_S = 60.0
"""A run that lasted this long before crashing starts a fresh retry cycle (attempt 1)."""

Run = Callable[[], Awaitable[object]]


async def supervise(
    run: Run,
    *,
    task: str,
    lock: str,
    retry: RetryStrategy,
    give_up_after: int | None = None,
    until: Callable[[], bool] | None = None,
) -> bool:
    """Run ``run()`` until it returns; restart it after a crash with ``retry``'s delays.

    A run that returns normally has finished for this leadership term. A run that
    lasted [`HEALTHY_RUN_S`][pgleaderlock.core.supervisor.HEALTHY_RUN_S] before crashing
    starts a fresh retry cycle.

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
            ctx = RetryContext(attempt, now - cycle_start, exc)
            delay = delay_or_give_up(retry, ctx, lock)
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


class Supervisor:
    """Named tasks, each run by [`supervise`][pgleaderlock.core.supervisor.supervise].

    A task is started once (starting a running one does nothing); stopping cancels it
    and awaits it for at most ``cancel_timeout_s``. One that outlives that is logged as
    an error (``<kind>_ignores_cancel``) and kept as a straggler: its name is not started
    again until it has ended, and `stop_all` cancels it once more.

    Args:
        kind: what the tasks are, for task names and log events (``leader_task``,
            ``worker``).
        label: the lock (or group) they serve, for logs.
        retry: delays between restarts of a crashed task.
        give_up_after: give a task up after this many crashes in a row (``None``: never).
        gave_up: called with the name of a task given up (by count or by the strategy).
        cancel_timeout_s: how long to await a cancelled task.
    """

    def __init__(
        self,
        *,
        kind: str,
        label: str,
        retry: RetryStrategy,
        give_up_after: int | None,
        gave_up: Callable[[str], None],
        cancel_timeout_s: float,
    ) -> None:
        self.kind, self.label = kind, label
        self.retry = retry
        self._give_up_after = give_up_after
        self._gave_up = gave_up
        self.cancel_timeout_s = cancel_timeout_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled, not ended yet
        self._cancelled: dict[str, asyncio.Task[None]] = {}  # by `cancel`, not awaited yet
        self._stragglers: dict[str, asyncio.Task[None]] = {}  # outlived cancel_timeout_s
        self._all: set[asyncio.Task[Any]] = set()  # every task started, until it ends
        self._idle: set[asyncio.Task[Any]] = set()  # in `idle` now: between units of work
        self._drained: set[asyncio.Task[Any]] = set()  # a drain waits for them

    @property
    def running(self) -> frozenset[str]:
        """The names whose task runs now."""
        return frozenset(name for name, task in self._tasks.items() if not task.done())

    def runs(self, name: str) -> bool:
        """Does the task ``name`` run now? (Cheap, unlike `running`: a Coordinator starts
        thousands of names at once.)"""
        current = self._tasks.get(name)
        return current is not None and not current.done()

    def start(self, name: str, run: Run, until: Callable[[], bool] | None = None) -> None:
        """Start ``run`` as the task ``name``, unless it runs (or a cancelled run of it
        has not ended yet: logged)."""
        if self.runs(name):
            return
        straggler = self._stragglers.get(name)
        if straggler is not None and not straggler.done():
            log.error(
                f"{self.kind}_not_started",
                task=name,
                lock=self.label,
                reason="its previous run has not ended after cancellation",
            )
            return
        task = self._tasks[name] = asyncio.get_running_loop().create_task(
            self._supervise(name, run, until), name=f"pgleaderlock-{self.kind}:{name}"
        )
        self._all.add(task)
        task.add_done_callback(self._all.discard)

    async def _supervise(self, name: str, run: Run, until: Callable[[], bool] | None) -> None:
        finished = await supervise(
            run,
            task=name,
            lock=self.label,
            retry=self.retry,
            give_up_after=self._give_up_after,
            until=until,
        )
        if not finished:
            self._gave_up(name)

    def _chosen(self, names: Iterable[str] | None) -> list[str]:
        return list(self._tasks) if names is None else [n for n in names if n in self._tasks]

    async def drain(
        self, names: Iterable[str] | None = None, timeout_s: float | None = None
    ) -> None:
        """Wait until the tasks of ``names`` (all when ``None``) have returned by
        themselves, for at most ``timeout_s`` (``None``: until cancelled); logged as
        ``<kind>s_draining``. A task that is in `idle` (between units of work) is
        ended at once, and one that comes to `idle` during the drain ends there: the
        drain waits only for the work that runs."""
        running = {n: self._tasks[n] for n in self._chosen(names) if not self._tasks[n].done()}
        for task in running.values():
            if task not in self._drained:
                self._drained.add(task)
                task.add_done_callback(self._drained.discard)
            if task in self._idle:
                task.cancel()
        if running and (timeout_s is None or timeout_s > 0):
            log.info(f"{self.kind}s_draining", lock=self.label, tasks=",".join(sorted(running)),
                     timeout_s=timeout_s)  # fmt: skip
            await asyncio.wait(running.values(), timeout=timeout_s)

    async def idle(self, seconds: float) -> None:
        """Sleep ``seconds`` between units of work, in one of these tasks: a drain does
        not wait for a task that sleeps here, it ends it (cancels it: the
        ``CancelledError`` comes out of this call), at once, or as it comes here."""
        task = asyncio.current_task()
        if task is None or task not in self._all:
            await asyncio.sleep(seconds)  # not one of these tasks: a plain sleep
            return
        if task in self._drained:
            task.cancel()  # the drain goes on without it: it ends here
        self._idle.add(task)
        try:
            await asyncio.sleep(seconds)
        finally:
            self._idle.discard(task)

    def cancel(self, names: Iterable[str] | None = None) -> None:
        """Cancel the tasks of ``names`` (all when ``None``) now, without waiting: the
        next `stop` of those names awaits them (a lock that leaves LEADER cancels every
        leader task at once, before its listeners await theirs one by one)."""
        for name in self._chosen(names):
            task = self._tasks.pop(name)
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
            self._cancelled[name] = task

    async def stop(self, names: Iterable[str] | None = None) -> list[str]:
        """Cancel the tasks of ``names`` (all when ``None``) and await them, within
        ``cancel_timeout_s``, with those `cancel` cancelled already; return the names
        that were running."""
        wanted = None if names is None else set(names)  # an iterator is read once
        self.cancel(wanted)
        chosen = {
            name: self._cancelled.pop(name)
            for name in list(self._cancelled)
            if wanted is None or name in wanted
        }
        running = {name: task for name, task in chosen.items() if not task.done()}
        if chosen:
            _, pending = await asyncio.wait(chosen.values(), timeout=self.cancel_timeout_s)
            for name, task in chosen.items():
                if task in pending:
                    self._straggle(name, task)
                else:
                    self._consume(task)
        return list(running)

    async def stop_all(self) -> None:
        """`stop` every task, and cancel once more those a stop is still waiting for and
        the stragglers; await them within ``cancel_timeout_s`` too."""
        left = {*self._stopping, *self._stragglers.values()}
        for task in left:
            task.cancel()
        await self.stop()
        left = {task for task in left if not task.done()}
        if left:
            await asyncio.wait(left, timeout=self.cancel_timeout_s)

    def _straggle(self, name: str, task: asyncio.Task[None]) -> None:
        log.error(
            f"{self.kind}_ignores_cancel",
            task=name,
            lock=self.label,
            timeout_s=self.cancel_timeout_s,
        )
        self._stragglers[name] = task
        task.add_done_callback(lambda done: self._ended(name, done))

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        if self._stragglers.get(name) is task:
            del self._stragglers[name]
        self._consume(task)

    def _consume(self, task: asyncio.Task[None]) -> None:
        """Retrieve a finished task's outcome, so asyncio never reports it as lost."""
        if task.done() and not task.cancelled():
            exc = task.exception()
            if exc is not None:
                log.error(f"{self.kind}_failed", task=task.get_name(), lock=self.label,
                          error=repr(exc))  # fmt: skip
