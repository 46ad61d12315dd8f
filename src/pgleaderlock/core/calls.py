"""Bounding the lifecycle task's database calls, and cutting them short on request.

Every call the lifecycle task makes on its session goes through one `CallGuard`:

- it is bounded by a timeout (a single timer handle: cheaper than ``asyncio.timeout``);
- on expiry the session is *aborted* (its socket closed, synchronously) before the task
  is cancelled, so that no driver spends seconds cancelling the statement on a server
  it cannot reach (psycopg does exactly that when a running query is cancelled);
- a stop request (or ``step_down()``'s timeout) may cut short the calls that allow it.

The caller learns why a call ended from the exception: `TimeoutError` for the timeout,
`CallInterrupted` for a request, anything else from the call itself. After a cut-short call the
session must be closed: a lock call cut short may still have been granted on the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ._logging import mask_dsn
from .errors import ConnectionError, PgLeaderLockError

__all__ = ["CallGuard", "CallInterrupted", "Interrupted", "bounded", "call_failure"]

T = TypeVar("T")


class CallInterrupted(PgLeaderLockError):
    """A lock's database call was cut short by a request (stop, or ``step_down()``'s
    timeout). The lifecycle task catches it; it never reaches the lock's callers, whose
    queued calls fail with a `ConnectionError` instead."""


Interrupted = CallInterrupted
"""Deprecated alias of `CallInterrupted`, its former name, kept for one release: it
clashed with ``pgleaderlock.schedule.Interrupted``, the policy for a run that its leader
did not finish."""


class CallGuard:
    """Runs one database call at a time under a timeout; see the module docstring.

    Args:
        abort: drops the current session's connection synchronously (no-op without
            one); called before a call is cancelled.
    """

    def __init__(self, abort: Callable[[], None]) -> None:
        self._abort = abort
        self._task: asyncio.Task[object] | None = None
        self._deadline: float | None = None  # loop time: when the call in flight expires
        self._timer: asyncio.TimerHandle | None = None  # fires at or before the deadline
        self._interruptible: frozenset[object] = frozenset()
        self._abort_on_interrupt = True
        self._cut: object = None  # "timeout", or the request that cut the call short

    async def __call__(
        self,
        awaitable: Awaitable[T],
        timeout_s: float,
        interruptible: object = None,
        abort_on_interrupt: bool = True,
    ) -> T:
        """Await ``awaitable``, bounded by ``timeout_s``.

        Args:
            awaitable: the call.
            timeout_s: its bound.
            interruptible: which request may cut it short, if any.
            abort_on_interrupt: abort the session when a request cuts the call short;
                False for a call whose driver should first cancel it on the server (a
                lock wait).

        Raises:
            TimeoutError: the call took longer than ``timeout_s``.
            CallInterrupted: a request cut it short.
        """
        task = asyncio.current_task()
        assert task is not None, "calls run in a task"
        assert self._task is None, "one call at a time"
        self._task = task
        self._interruptible = frozenset() if interruptible is None else frozenset({interruptible})
        self._abort_on_interrupt = abort_on_interrupt
        loop = asyncio.get_running_loop()
        self._deadline = deadline = loop.time() + timeout_s
        # One timer, re-armed lazily: calls with the usual timeout reuse it, instead of
        # adding (and cancelling) a timer per call to the loop's heap.
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(deadline, self._on_timer)
        try:
            return await awaitable
        except (asyncio.CancelledError, Exception):
            reason = self._cut
            if reason is None:
                raise  # cancelled from outside, or the call's own error: not ours
            # Our cancellation, or an error the driver made of it while it cleaned up on
            # the dropped session (psycopg: "connection pointer is NULL"): the cut
            # explains either, and its cancel request is spent.
            if task.cancelling():
                task.uncancel()
            if reason == "timeout":
                raise TimeoutError from None
            raise CallInterrupted(reason) from None
        finally:
            self._deadline = None
            self._task = None
            self._interruptible = frozenset()
            self._cut = None

    def interrupt(self, reason: object) -> None:
        """Cut short the call in flight, if it allows ``reason``; else do nothing."""
        if reason in self._interruptible:
            self._cut_short(reason, abort=self._abort_on_interrupt)

    def allow(self, reasons: frozenset[object]) -> None:
        """Let ``reasons`` cut short the call in flight from now on (the session is then
        aborted): for a call that may go on after the task stopped relying on it."""
        if self._task is not None:
            self._interruptible = self._interruptible | reasons
            self._abort_on_interrupt = True

    def close(self) -> None:
        """Drop the timer (when the lock's task ends)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return  # no call in flight: arm again with the next one
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline:
            self._cut_short("timeout", abort=True)
        else:  # the call in flight started after the timer was armed
            self._timer = loop.call_at(deadline, self._on_timer)

    def _cut_short(self, reason: object, *, abort: bool) -> None:
        task = self._task
        if task is None or self._cut is not None:
            return
        self._cut = reason
        if abort:
            self._abort()
        task.cancel()


def call_failure(exc: Exception, what: str, timeout_s: float) -> Exception:
    """The error a failed call reports: the library's own errors pass through; a timeout
    or a stray error becomes a ``ConnectionError`` that says what failed (and keeps the
    original as its cause)."""
    if isinstance(exc, PgLeaderLockError):
        return exc
    if isinstance(exc, TimeoutError):
        err = ConnectionError(f"{what} timed out after {timeout_s:g} s")
    else:
        err = ConnectionError(mask_dsn(f"{what} failed: {type(exc).__name__}: {exc}"))
    err.__cause__ = exc
    return err


async def bounded(awaitable: Awaitable[T], timeout_s: float, abort: Callable[[], None]) -> T:
    """``await awaitable`` under a `CallGuard` of its own, for a caller that is not a
    lock's lifecycle task (a Coordinator's sessions): bounded by ``timeout_s``, the
    session dropped (``abort``) before the call is cancelled.

    Raises:
        TimeoutError: the call took longer than ``timeout_s``.
    """
    guard = CallGuard(abort)
    try:
        return await guard(awaitable, timeout_s)
    finally:
        guard.close()
