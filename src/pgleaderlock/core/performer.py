"""Performs the database calls the machine asks for (its `Call` effects) on the lock's
session, each bounded by the [`CallGuard`][pgleaderlock.core.calls.CallGuard]: the lock
calls, the probe, the fencing term, the work queued for the leader's session
(`run_on_session`), and a call that outlives its soft timeout (a late call, which the
machine reports and then awaits). It decides nothing: what to call, and when, is the
machine's; the runner hands each call here.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, cast

from .calls import CallGuard, CallInterrupted, call_failure
from .errors import ConfigurationError, ConnectionError, UnclaimedGrantError
from .keyring import Keyring
from .machine import (
    Answered,
    Call,
    Connected,
    CutShort,
    Failed,
    FencedEnded,
    Late,
    Machine,
    Op,
    Request,
    Result,
    TermBlocked,
    TermBumped,
)
from .session import FencingSession, TransportSession, WaitingSession
from .slot import SessionSlot, can

__all__ = ["CallPerformer", "first", "probe_outcome", "resolve"]

Queued = tuple[Callable[[SessionSlot], Awaitable[Any]], float, "asyncio.Future[Any]"]
"""A call for the leader's session (``on_session``): the function, its timeout, and the
future its caller awaits."""


class CallPerformer:
    """Performs one lock's database calls.

    Args:
        machine: what the calls are for (its config; the requests a late call allows).
        slot: holds the session.
        keys: the lock's keys, or the keyring that chooses among several.
    """

    def __init__(self, machine: Machine, slot: SessionSlot, keys: Keyring) -> None:
        self._machine, self._slot, self._keys = machine, slot, keys
        self.guard = CallGuard(slot.abort)  # bounds every database call
        self.late: asyncio.Task[Result] | None = None  # a call reported Late, still running
        self.queued: list[Queued] = []  # calls for the leader's session (on_session)
        # A stop cut short the leader's queued work, which dropped the session: the lock
        # is released with it (the server frees a closed session's locks), so the
        # release sends no unlock down the closed connection.
        self._dropped_by_cut = False
        # Asked right after a lock call granted the lock, before the machine hears of
        # it: False when the lock is reserved for another candidate (a targeted
        # hand-over); it has then released the lock again, and the attempt failed.
        self.admit: Callable[[SessionSlot], Awaitable[bool]] | None = None

    async def perform_soft(self, call: Call, soft_timeout_s: float) -> Result:
        """Run ``call``; after ``soft_timeout_s`` report ``Late`` and keep it running in
        a task of its own, which an ``Await`` effect waits for.

        A probe that the session starts as a future
        ([`ProbingSession`][pgleaderlock.backends.ProbingSession]) is awaited directly,
        and gets its task only when it is late: this runs for every health probe of
        every leader. Otherwise the call runs in a task from the start.
        """
        loop = asyncio.get_running_loop()
        probe = self._slot.start_probe() if call.op is Op.PROBE else None
        if probe is not None:
            started = loop.time()
            if not await first(probe, soft_timeout_s, self._slot.abort):
                late = self.go_late(probe, call, started)
                await asyncio.sleep(0)  # it starts now, bounded before anyone may cut it short
                return late
            return probe_outcome(probe, call)
        task = loop.create_task(self.perform(call))
        if not await first(task, soft_timeout_s, None):
            self.late = task
            return self.report_late()
        return task.result()

    def go_late(self, probe: asyncio.Future[None], call: Call, started: float) -> Result:
        """A probe started at ``started`` (loop time) is late: await it in a task of its
        own for what is left of its bound, and report it."""
        loop = asyncio.get_running_loop()
        remaining = max(0.0, call.timeout_s - (loop.time() - started))
        self.late = loop.create_task(self.perform(call, probe, remaining))
        return self.report_late()

    def report_late(self) -> Result:
        session = self._slot.session
        acked = None
        if session is not None and can(session, TransportSession):
            acked = cast(TransportSession, session).acknowledged()
        return Late(acknowledged=acked)

    async def drop_late(self) -> None:
        task, self.late = self.late, None
        if task is not None:
            self._slot.abort()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def await_late(self, reasons: frozenset[Request]) -> Result:
        task, self.late = self.late, None
        assert task is not None, "Await without a late call"
        self.guard.allow(frozenset(reasons))
        for reason in reasons:  # requests that came while the late call was reported
            if self._machine.requested(reason):
                self.guard.interrupt(reason)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise

    async def perform(
        self, call: Call, probe: asyncio.Future[None] | None = None, timeout_s: float = 0.0
    ) -> Result:
        """Perform ``call`` bounded by the `CallGuard` (``probe``: a late probe already
        started, to await for at most ``timeout_s`` more)."""
        guard, session = self.guard, self._slot.session
        bound = (call.timeout_s, call.interruptible, call.abort_on_interrupt)
        keys = k1, k2 = self._keys.held
        try:
            if probe is not None:
                await guard(probe, timeout_s, call.interruptible, call.abort_on_interrupt)
                return Answered(True)
            if call.op is Op.CONNECT:
                self._dropped_by_cut = False
                session = await guard(self._slot.open(), *bound)
                return Connected(can_wait=can(session, WaitingSession))
            assert session is not None, call
            match call.op:
                case Op.TRY_LOCK:
                    value = await guard(self._keys.try_lock(session), *bound)
                case Op.WAIT_LOCK:
                    waiting = cast(WaitingSession, session)
                    if not self._keys.waits_on_server:  # tries: drop the session, then cut
                        bound = (call.timeout_s, call.interruptible, True)
                    value = await guard(self._keys.wait_lock(waiting, call.wait_s), *bound)
                case Op.PROBE:
                    value = await guard(self._slot.holds(k1, k2), *bound)
                case Op.UNLOCK if self._dropped_by_cut:
                    value = True  # released by dropping the session (see __init__)
                case Op.UNLOCK:
                    value = await guard(session.unlock(k1, k2), *bound)
                case Op.WORK:
                    value = await self._run_queued(call)
                case Op.BUMP_TERM | Op.END_FENCED:
                    table = self._machine.config.term_table
                    if table is None or not can(session, FencingSession):
                        raise ConfigurationError(
                            f"fencing needs sessions that can bump a term; {session!r} cannot"
                        )
                    fencing = cast(FencingSession, session)
                    if call.op is Op.END_FENCED:
                        return FencedEnded(await guard(fencing.end_fenced(table, [keys]), *bound))
                    bump = functools.partial(fencing.bump_term, table, k1, k2, call.wait_s)
                    term = await guard(self._slot.with_table(table, bump), *bound)
                    if term is None:
                        return TermBlocked()
                    prior = getattr(term, "prior", None)  # a BumpedTerm says
                    return TermBumped(int(term), prior, getattr(term, "prior_at", None))
            if value and call.op in (Op.TRY_LOCK, Op.WAIT_LOCK):
                admit = self.admit  # a statement: the session is dropped before it is cut
                if admit is not None and not await guard(admit(self._slot), *bound[:2]):
                    return Answered(False)  # reserved for another: let go, unannounced
                self._slot.granted()  # the next probe asks pg_locks
            return Answered(bool(value))
        except CallInterrupted:
            self._dropped_by_cut = call.op is Op.WORK  # its cut aborts the session
            return CutShort()
        except Exception as exc:
            if isinstance(exc, UnclaimedGrantError):
                self._slot.claim_failed()  # this process was slow: longer claims from now
            return Failed(call_failure(exc, call.what or call.op.value, call.timeout_s))

    async def _run_queued(self, call: Call) -> bool:
        """Run the calls queued so far, in order, each bounded by its own timeout (those
        queued meanwhile wait for the next ``WORK`` call, after a probe if one is due);
        the first that fails fails the rest (the session is lost)."""
        batch, self.queued = self.queued, []
        for i, (fn, timeout_s, future) in enumerate(batch):
            if future.done():
                continue  # its caller gave up
            try:
                result = await self.guard(fn(self._slot), timeout_s, call.interruptible)
            except BaseException as exc:
                cut = isinstance(exc, CallInterrupted)
                if cut:
                    error: Exception = ConnectionError("the lock is stopping")
                elif isinstance(exc, Exception):
                    error = call_failure(exc, call.what or "session work", timeout_s)
                else:
                    error = ConnectionError("the lock stopped")
                self.fail_queued(error, *(item[2] for item in batch[i:]))
                if cut or error is exc or not isinstance(exc, Exception):
                    raise
                raise error from exc  # the lock logs what its caller got (its own bound)
            if not future.done():
                future.set_result(result)
        return True

    def fail_queued(self, error: Exception, *also: asyncio.Future[Any]) -> None:
        queued, self.queued = self.queued, []
        for future in (*also, *(item[2] for item in queued)):
            if not future.done():
                future.set_exception(error)


def resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def probe_outcome(probe: asyncio.Future[None], call: Call) -> Result:
    """What a probe that has ended tells the machine."""
    exc = RuntimeError("the probe was cancelled") if probe.cancelled() else probe.exception()
    if exc is None:
        return Answered(True)
    return Failed(call_failure(cast(Exception, exc), call.what or "health check", call.timeout_s))


def _ended(waiter: asyncio.Future[None], _: object) -> None:
    resolve(waiter)


async def first(
    work: asyncio.Future[Any], timeout_s: float, abort: Callable[[], None] | None
) -> bool:
    """Wait until ``work`` is done (True) or ``timeout_s`` has passed (False), with one
    future and one timer (``asyncio.wait`` costs several times more, and this runs for
    every health probe). If the wait is cancelled, so is ``work`` (``abort`` called
    first)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    timer = loop.call_later(timeout_s, resolve, waiter)
    ended = functools.partial(_ended, waiter)
    work.add_done_callback(ended)
    try:
        await waiter
    except asyncio.CancelledError:
        if abort is not None:
            abort()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise
    finally:
        timer.cancel()
        work.remove_done_callback(ended)
    return work.done()
