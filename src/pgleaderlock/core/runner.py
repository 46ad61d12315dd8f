"""The lifecycle task: performs the machine's effects, in order, and reports outcomes.

The runner decides nothing. It asks [`Machine.handle`][pgleaderlock.core.machine.Machine.handle]
what to do, does it (database calls bounded by [`CallGuard`][pgleaderlock.core.calls.CallGuard],
sleeps, callbacks, logs, closing the session) and hands the outcome of the one blocking
effect back as the next result, until the machine returns no blocking effect (STOPPED).
It never assigns a state.

It also holds what the public coroutines wait on: the start of the task, the end of a
`step_down()`, leadership (`wait_for_leadership()`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from ._logging import get_logger
from .calls import CallGuard, CallInterrupted, call_failure
from .errors import ConfigurationError, ConnectionError, UnclaimedGrantError
from .keyring import FixedKeys, Keyring
from .machine import (
    Aborted,
    Answered,
    Await,
    Call,
    CloseSession,
    Connected,
    CutShort,
    Effect,
    Emit,
    EndDrain,
    Failed,
    FencedEnded,
    Late,
    Log,
    Machine,
    Op,
    ReleaseDone,
    Request,
    Result,
    Sleep,
    StartDrain,
    Started,
    StopLeaderWork,
    TermBlocked,
    TermBumped,
    WatchSession,
    Woke,
    idle_step,
)
from .models import Event, LockState
from .session import (
    FencingSession,
    KeepAliveSession,
    ProbingSession,
    TransportSession,
    WaitingSession,
)
from .slot import SessionSlot, can

__all__ = ["Runner"]

T = TypeVar("T")
_Queued = tuple[Callable[[SessionSlot], Awaitable[Any]], float, "asyncio.Future[Any]"]

log = get_logger()

ABNORMAL_STOP_CALLBACKS_S = 1.0
"""How long the callbacks of a forced or crashed stop may take."""

Emitter = Callable[[Event, dict[str, Any]], Awaitable[None]]


class Runner:
    """Runs one lock's lifecycle task.

    Args:
        machine: decides.
        slot: holds the session.
        emit: runs an event's callbacks and hooks.
        keys: the lock's `(key1, key2)`, or a
            [`Keyring`][pgleaderlock.core.keyring.Keyring] that chooses among several
            (a semaphore's slots).
        log_fields: added to every log record (the lock's name and keys).
    """

    def __init__(
        self,
        machine: Machine,
        slot: SessionSlot,
        emit: Emitter,
        keys: tuple[int, int] | Keyring,
        log_fields: dict[str, Any],
    ) -> None:
        self._machine, self._slot, self._emit_hook = machine, slot, emit
        self._keys: Keyring = FixedKeys(*keys) if isinstance(keys, tuple) else keys
        self._fields = log_fields
        self._call = CallGuard(slot.abort)  # bounds every database call
        self._woken = False  # a request arrived since the machine last looked
        self._sleeper: asyncio.Future[None] | None = None  # a sleep a request ends early
        self.task: asyncio.Task[None] | None = None
        self._started: asyncio.Future[None] | None = None
        self._leader_waiters: set[asyncio.Future[None]] = set()
        self._release_done: asyncio.Future[None] | None = None
        self._leader_ready = False  # LEADER, and the transition's callbacks have run
        self._late: asyncio.Task[Result] | None = None  # a call reported Late, still running
        # Between probes a leader runs without its task (see `_idle`): what it waits for.
        self._handoff: asyncio.Future[Result | list[Effect]] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None  # the next probe, or its lateness
        self._idle_probe: tuple[asyncio.Future[None], Call, float] | None = None
        self._stop_reported = False  # on_stopped has run for this run of the task
        self._drain: asyncio.Task[None] | None = None  # the on_draining callbacks
        self._queued: list[_Queued] = []  # calls for the leader's session (on_session)
        # Run on the session before the ACQUIRED callbacks (the lock publishes that it
        # leads and notifies listeners); it must not raise but a timeout.
        self.announce: Callable[[SessionSlot], Awaitable[None]] | None = None
        # Asked right after a lock call granted the lock, before the machine hears of
        # it: False when the lock is reserved for another candidate (a targeted
        # hand-over); it has then released the lock again, and the attempt failed.
        self.admit: Callable[[SessionSlot], Awaitable[bool]] | None = None
        # Called (synchronously) the moment the lock leaves LEADER, before any callback:
        # cancels the leader work that follows the lock (follow_state's ``leaving``).
        self.leaving: Callable[[], None] | None = None

    # ------------------------------------------------------------------ for the API

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, name: str, external_stop: asyncio.Event | None) -> asyncio.Future[None]:
        """Start the task unless it runs; return what resolves once it made its first
        decision."""
        if not self.running:
            loop = asyncio.get_running_loop()
            self._stop_reported = False
            self._started = loop.create_future()
            self.task = loop.create_task(self._run(external_stop), name=name)
        assert self._started is not None
        return self._started

    def request(self, request: Request) -> bool:
        """Hand a request to the machine, wake the task, and cut short the call in
        flight if that call allows this request. Returns the machine's answer."""
        accepted = self._machine.request(request)
        self._woken = True
        _resolve(self._sleeper)
        if self._handoff is not None and self._idle_probe is None:
            self._hand_off(Woke())  # idle between probes: the task decides
        self._call.interrupt(request)
        return accepted

    async def on_session(self, fn: Callable[[SessionSlot], Awaitable[T]], timeout_s: float) -> T:
        """``fn(slot)`` on the leader's session, as a call the machine schedules (see
        [`run_on_session`][pgleaderlock.core.lock.run_on_session])."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queued = (fn, timeout_s, future)
        self._queued.append(queued)
        if not self.running or not self.request(Request.WORK):
            self._queued.remove(queued)
            raise ConnectionError(f"not leading ({self._machine.state.value}): no session to use")
        try:
            return cast(T, await future)
        finally:
            future.cancel()  # given up before it ran: it does not run

    def release_done(self) -> asyncio.Future[None]:
        """Resolves when the pending `step_down()` is over."""
        if self._release_done is None:
            self._release_done = asyncio.get_running_loop().create_future()
        return self._release_done

    async def wait_leader(self) -> bool:
        """Until LEADER with its `on_acquired` callbacks run (True), or stopped (False)."""
        loop = asyncio.get_running_loop()
        while True:
            if self._leader_ready and self._machine.state is LockState.LEADER:
                return True
            if not self.running:
                return False
            waiter = loop.create_future()
            self._leader_waiters.add(waiter)
            try:
                await waiter
            finally:
                self._leader_waiters.discard(waiter)

    def abort(self) -> None:
        """Drop the session now (a forced shutdown is about to cancel the task)."""
        self._slot.abort()

    # ------------------------------------------------------------------ the task

    async def _run(self, external_stop: asyncio.Event | None) -> None:
        watcher = None
        if external_stop is not None:
            watcher = asyncio.get_running_loop().create_task(self._watch(external_stop))
        crash: Exception | None = None
        try:
            outcome: Result | list[Effect] | None = Started()
            while outcome is not None:
                if isinstance(outcome, list):  # handed back by an idle leader
                    effects = outcome
                else:
                    self._woken = False  # the machine sees every request made before this
                    effects = self._machine.handle(outcome, time.monotonic())
                outcome = await self._perform(effects)
        except Exception as exc:  # a bug: the machine reports it while stopping
            crash = exc
        finally:
            for pending in (watcher, self._late, self._drain):
                if pending is not None:
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)
            self._late = self._drain = None
            self._call.close()
            self._fail_queued(ConnectionError("the lock stopped"))
            await self._slot.close()
            await self._stop_abnormally(crash)
            self._settle()
            self._resolve_release()

    async def _watch(self, event: asyncio.Event) -> None:
        await event.wait()
        self.request(Request.STOP)

    async def _stop_abnormally(self, crash: Exception | None) -> None:
        """After a cancellation (forced shutdown) or a crash, the machine still reports
        the stop; its callbacks get a short, fixed time, as one of them may be what
        blocked the orderly stop in the first place."""
        if self._machine.state is LockState.STOPPED and self._stop_reported and not crash:
            return
        aborted = Aborted(crash, self._stop_reported)
        try:
            async with asyncio.timeout(ABNORMAL_STOP_CALLBACKS_S):
                await self._perform(self._machine.handle(aborted, time.monotonic()))
        except (TimeoutError, asyncio.CancelledError):
            log.warning("stop_callbacks_abandoned", **self._fields)

    async def _perform(self, effects: list[Effect]) -> Result | list[Effect] | None:
        """Perform `effects` in order; return the outcome of the blocking one (None
        when there is none: the lock has stopped), or the effects an idle leader hands
        back to the task."""
        for effect in effects:
            match effect:
                case Emit(event=event):
                    if event is Event.STOPPED:
                        self._stop_reported = True
                    elif event is Event.ACQUIRED and self.announce is not None:
                        await self._announce(self.announce)
                    await self._keeping_alive(self._emit(effect), effect.keepalive_s)
                case StartDrain():
                    drain = asyncio.get_running_loop().create_task(
                        self._emit(Emit(Event.DRAINING)), name=_task_name(self.task, "drain")
                    )
                    drain.add_done_callback(self._drained)
                    self._drain = drain
                case EndDrain():
                    await self._end_drain()
                case Log():
                    self._log(effect)
                case StopLeaderWork():
                    self._fail_queued(
                        ConnectionError(
                            f"not leading ({self._machine.state.value}): the call queued "
                            "for the session did not run"
                        )
                    )
                    if self.leaving is not None:
                        self.leaving()
                case CloseSession():
                    await self._drop_late()  # a late call on it is abandoned
                    self._fail_queued(ConnectionError("the session was closed"))
                    await self._slot.close()
                case WatchSession():
                    self._slot.watch(self._alarm)
                case ReleaseDone():
                    self._resolve_release()
                case Call():
                    self._settle()
                    if self._machine.preempted(effect):
                        return CutShort()
                    if effect.soft_timeout_s is None:
                        return await self._perform_call(effect)
                    return await self._perform_soft(effect, effect.soft_timeout_s)
                case Await(interruptible=reasons):
                    self._settle()
                    return await self._await_late(reasons)
                case Sleep(until=until):
                    self._settle()
                    if self._machine.state is LockState.LEADER and self._can_probe():
                        return await self._idle(until)
                    await self._sleep_until(until)
                    return Woke()
        self._settle()
        return None

    # ------------------------------------------------------------------ callbacks

    async def _emit(self, effect: Emit) -> None:
        await self._emit_hook(effect.event, {
            "old": effect.old, "new": effect.new,
            "error": effect.error, "attempt": effect.attempt,
        })  # fmt: skip

    async def _announce(self, announce: Callable[[SessionSlot], Awaitable[None]]) -> None:
        """``announce`` on the new leader's session, bounded like a lock call; a
        timeout drops the session (the next probe then reports the loss)."""
        try:
            await self._call(announce(self._slot), self._machine.config.command_timeout_s)
        except TimeoutError:
            log.warning("announce_timeout", **self._fields)

    async def _keeping_alive(self, work: Awaitable[None], every_s: float | None) -> None:
        """``await work`` (callbacks); meanwhile, with ``every_s``, show the server every
        ``every_s`` that the client lives (a keep-alive on the session, whose answer
        nobody waits for), so that callbacks slower than the lease do not cost the
        lock: the lease measures the event loop's life, not the callbacks' speed. A
        keep-alive still unanswered ``health_timeout_s`` after the callbacks drops the
        session (the next call then fails, as it would have)."""
        if every_s is None:
            await work
            return
        loop = asyncio.get_running_loop()
        alive: asyncio.Future[None] | None = None
        timer: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal alive, timer
            if alive is None or alive.done():
                alive = self._keep_alive()
            timer = loop.call_later(every_s, tick)

        timer = loop.call_later(every_s, tick)
        try:
            await work
        finally:
            timer.cancel()
            if alive is not None and not alive.done():
                bound = self._machine.config.health_timeout_s
                if not await _first(alive, bound, self._slot.abort):
                    self._slot.abort()
                    alive.cancel()
                    await asyncio.gather(alive, return_exceptions=True)

    def _keep_alive(self) -> asyncio.Future[None] | None:
        session = self._slot.session
        if session is None or not can(session, KeepAliveSession):
            return None
        alive = cast(KeepAliveSession, session).keep_alive()
        if alive is not None:
            alive.add_done_callback(_retrieve)
        return alive

    def _drained(self, drain: asyncio.Task[None]) -> None:
        """The ``on_draining`` callbacks have returned (not cancelled): tell the machine."""
        if drain is self._drain and not drain.cancelled():
            self.request(Request.DRAINED)

    async def _end_drain(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)

    # ------------------------------------------------------------------ idle leader

    # An idle leader sleeps, probes, and sleeps again, hundreds of times a second with a
    # thousand leaders in one process. While the machine asks for nothing but that (and
    # logs, and re-arming the watch), the loop runs in plain callbacks on the event loop
    # instead of waking the task twice per probe: a timer starts the probe, the probe's
    # answer goes to the machine, and the machine's next Sleep arms the timer again. The
    # machine decides every step as before; anything else it asks for (callbacks, a
    # late or failed probe, a request) is handed back to the task, which performs it.
    # Which effect lists are an idle step is the machine's contract: `idle_step`.

    def _can_probe(self) -> bool:
        session = self._slot.session
        return session is not None and can(session, ProbingSession)

    async def _idle(self, until: float) -> Result | list[Effect]:
        """Run the idle leader's probe loop in callbacks until the machine asks for
        more than probes and sleeps; return what the task is to do next."""
        loop = asyncio.get_running_loop()
        handoff: asyncio.Future[Result | list[Effect]] = loop.create_future()
        self._handoff = handoff
        if self._woken:
            self._hand_off(Woke())
        else:
            self._idle_sleep(until)
        try:
            return await handoff
        finally:
            self._handoff = None
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            pending, self._idle_probe = self._idle_probe, None
            if pending is not None:  # cancelled with a probe in flight: drop the session
                self._slot.abort()
                pending[0].cancel()

    def _idle_sleep(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + (until - time.monotonic())
        self._idle_timer = loop.call_at(when, self._idle_step, Woke())

    def _idle_step(self, result: Result) -> None:
        """Hand ``result`` to the machine; perform its effects here if they are an idle
        leader's step ([`idle_step`][pgleaderlock.core.machine.idle_step]: logs, the
        watch, then a sleep, or a probe the session starts as a future), else hand
        them to the task."""
        self._idle_timer = None
        try:
            self._woken = False  # the machine sees every request made before this
            effects = self._machine.handle(result, time.monotonic())
            step = idle_step(effects) if self._machine.state is LockState.LEADER else None
            if step is None:
                self._hand_off(effects)
                return
            for record in step.logs:
                self._log(record)
            if step.watch:
                self._slot.watch(self._alarm)
            wait = step.wait
            if isinstance(wait, Sleep):
                self._settle()
                self._idle_sleep(wait.until)
            elif not self._machine.preempted(wait) and (probe := self._start_probe()) is not None:
                self._settle()
                loop = asyncio.get_running_loop()
                self._idle_probe = (probe, wait, loop.time())
                self._idle_timer = loop.call_later(
                    cast(float, wait.soft_timeout_s), self._idle_late
                )
                probe.add_done_callback(self._idle_answered)
            else:
                self._hand_off([wait])  # the probe needs the task (holds())
        except Exception as exc:  # a bug: the task reports it
            self._hand_off(exc)

    def _idle_answered(self, probe: asyncio.Future[None]) -> None:
        pending, self._idle_probe = self._idle_probe, None
        if pending is None or pending[0] is not probe:
            return  # reported late (or the idle loop was left) before it answered
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        outcome = _probe_outcome(probe, pending[1])
        if isinstance(outcome, Answered):
            self._idle_step(outcome)
        else:
            self._hand_off(outcome)

    def _idle_late(self) -> None:
        """The probe is late: from here on it is awaited in a task of its own, as in
        `_perform_soft`, and the task reports it."""
        self._idle_timer = None
        pending, self._idle_probe = self._idle_probe, None
        if pending is None:
            return
        self._hand_off(self._go_late(*pending))  # before the task wakes: its guard first

    def _hand_off(self, outcome: Result | list[Effect] | Exception) -> None:
        handoff = self._handoff
        if handoff is None or handoff.done():
            return
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if isinstance(outcome, Exception):
            handoff.set_exception(outcome)
        else:
            handoff.set_result(outcome)

    async def _perform_soft(self, call: Call, soft_timeout_s: float) -> Result:
        """Run ``call``; after ``soft_timeout_s`` report ``Late`` and keep it running in
        a task of its own, which an ``Await`` effect waits for.

        A probe that the session starts as a future
        ([`ProbingSession`][pgleaderlock.backends.ProbingSession]) is awaited directly,
        and gets its task only when it is late: this runs for every health probe of
        every leader. Otherwise the call runs in a task from the start.
        """
        loop = asyncio.get_running_loop()
        probe = self._start_probe() if call.op is Op.PROBE else None
        if probe is not None:
            started = loop.time()
            if not await _first(probe, soft_timeout_s, self._slot.abort):
                late = self._go_late(probe, call, started)
                await asyncio.sleep(0)  # it starts now, bounded before anyone may cut it short
                return late
            return _probe_outcome(probe, call)
        task = loop.create_task(self._perform_call(call))
        if not await _first(task, soft_timeout_s, None):
            self._late = task
            return self._report_late()
        return task.result()

    def _start_probe(self) -> asyncio.Future[None] | None:
        return self._slot.start_probe()

    def _go_late(self, probe: asyncio.Future[None], call: Call, started: float) -> Result:
        """A probe started at ``started`` (loop time) is late: await it in a task of its
        own for what is left of its bound, and report it."""
        loop = asyncio.get_running_loop()
        remaining = max(0.0, call.timeout_s - (loop.time() - started))
        self._late = loop.create_task(self._perform_call(call, probe, remaining))
        return self._report_late()

    def _report_late(self) -> Result:
        session = self._slot.session
        acked = None
        if session is not None and can(session, TransportSession):
            acked = cast(TransportSession, session).acknowledged()
        return Late(acknowledged=acked)

    async def _drop_late(self) -> None:
        task, self._late = self._late, None
        if task is not None:
            self._slot.abort()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _await_late(self, reasons: frozenset[Request]) -> Result:
        task, self._late = self._late, None
        assert task is not None, "Await without a late call"
        self._call.allow(frozenset(reasons))
        for reason in reasons:  # requests that came while the late call was reported
            if self._machine.requested(reason):
                self._call.interrupt(reason)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise

    async def _perform_call(
        self, call: Call, probe: asyncio.Future[None] | None = None, timeout_s: float = 0.0
    ) -> Result:
        """Perform ``call`` bounded by the `CallGuard` (``probe``: a late probe already
        started, to await for at most ``timeout_s`` more)."""
        guard, session = self._call, self._slot.session
        bound = (call.timeout_s, call.interruptible, call.abort_on_interrupt)
        keys = k1, k2 = self._keys.held
        try:
            if probe is not None:
                await guard(probe, timeout_s, call.interruptible, call.abort_on_interrupt)
                return Answered(True)
            if call.op is Op.CONNECT:
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
                    return TermBlocked() if term is None else TermBumped(term)
            if value and call.op in (Op.TRY_LOCK, Op.WAIT_LOCK):
                admit = self.admit  # a statement: the session is dropped before it is cut
                if admit is not None and not await guard(admit(self._slot), *bound[:2]):
                    return Answered(False)  # reserved for another: let go, unannounced
                self._slot.granted()  # the next probe asks pg_locks
            return Answered(bool(value))
        except CallInterrupted:
            return CutShort()
        except Exception as exc:
            if isinstance(exc, UnclaimedGrantError):
                self._slot.claim_failed()  # this process was slow: longer claims from now
            return Failed(call_failure(exc, call.what or call.op.value, call.timeout_s))

    async def _run_queued(self, call: Call) -> bool:
        """Run the calls queued so far, in order, each bounded by its own timeout (those
        queued meanwhile wait for the next ``WORK`` call, after a probe if one is due);
        the first that fails fails the rest (the session is lost)."""
        batch, self._queued = self._queued, []
        for i, (fn, timeout_s, future) in enumerate(batch):
            if future.done():
                continue  # its caller gave up
            try:
                result = await self._call(fn(self._slot), timeout_s, call.interruptible)
            except BaseException as exc:
                cut = isinstance(exc, CallInterrupted)
                if cut:
                    error: Exception = ConnectionError("the lock is stopping")
                elif isinstance(exc, Exception):
                    error = call_failure(exc, call.what or "session work", timeout_s)
                else:
                    error = ConnectionError("the lock stopped")
                self._fail_queued(error, *(item[2] for item in batch[i:]))
                if cut or error is exc or not isinstance(exc, Exception):
                    raise
                raise error from exc  # the lock logs what its caller got (its own bound)
            if not future.done():
                future.set_result(result)
        return True

    def _fail_queued(self, error: Exception, *also: asyncio.Future[Any]) -> None:
        queued, self._queued = self._queued, []
        for future in (*also, *(item[2] for item in queued)):
            if not future.done():
                future.set_exception(error)

    def _settle(self) -> None:
        """The effects before a wait have run: wake `wait_for_leadership()` callers
        (LEADER counts once its `on_acquired` callbacks ran) and `start()`."""
        self._leader_ready = self._machine.state is LockState.LEADER
        for waiter in self._leader_waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._started is not None and not self._started.done():
            self._started.set_result(None)

    async def _sleep_until(self, deadline: float) -> None:
        """Sleep until `deadline` (monotonic) or until a request wakes the task."""
        if self._woken:
            return
        loop = asyncio.get_running_loop()
        sleeper = self._sleeper = loop.create_future()
        timer = loop.call_at(loop.time() + (deadline - time.monotonic()), _resolve, sleeper)
        try:
            await sleeper
        finally:
            timer.cancel()
            self._sleeper = None

    def _log(self, record: Log) -> None:
        if not log.enabled(record.level):
            return  # most often a debug record, on every probe
        fields = {**dict(record.fields), **self._fields}
        if self._slot.session is not None:
            fields.setdefault("backend_pid", self._slot.backend_pid)
        getattr(log, record.level)(record.message, exc=record.exc, **fields)

    def _resolve_release(self) -> None:
        done, self._release_done = self._release_done, None
        if done is not None and not done.done():
            done.set_result(None)

    def _alarm(self) -> None:
        """The watched idle session became readable: most likely the server ended it."""
        self.request(Request.ALARM)


def _task_name(task: asyncio.Task[None] | None, what: str) -> str:
    return f"{task.get_name() if task is not None else 'pgleaderlock'}-{what}"


def _retrieve(future: asyncio.Future[None]) -> None:
    """A keep-alive's outcome matters to nobody (the next probe tells): retrieve it, so
    that asyncio does not report it as lost."""
    if not future.cancelled():
        future.exception()


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _probe_outcome(probe: asyncio.Future[None], call: Call) -> Result:
    """What a probe that has ended tells the machine."""
    exc = RuntimeError("the probe was cancelled") if probe.cancelled() else probe.exception()
    if exc is None:
        return Answered(True)
    return Failed(call_failure(cast(Exception, exc), call.what or "health check", call.timeout_s))


def _ended(waiter: asyncio.Future[None], _: object) -> None:
    _resolve(waiter)


async def _first(
    work: asyncio.Future[Any], timeout_s: float, abort: Callable[[], None] | None
) -> bool:
    """Wait until ``work`` is done (True) or ``timeout_s`` has passed (False), with one
    future and one timer (``asyncio.wait`` costs several times more, and this runs for
    every health probe). If the wait is cancelled, so is ``work`` (``abort`` called
    first)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    timer = loop.call_later(timeout_s, _resolve, waiter)
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
