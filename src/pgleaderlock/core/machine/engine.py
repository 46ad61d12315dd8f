"""The decision engine: turns results and requests into table inputs, and the rows'
actions into effects. Every policy of the lock lives here (see the package docstring).

It is longer than the other modules on purpose: `Machine` is the one place that holds
one lock's state (its requests, its session as far as decisions go, its retry and
health schedules), and every decision reads and writes that state. The rules that need
none of it live beside it: the table (`table.py`), the effects (`effects.py`), the run
of errors (`failing.py`).
"""

from __future__ import annotations

import functools
import math
import random
from typing import cast

from .._logging import mask_dsn
from ..config import LockConfig
from ..errors import (
    ConfigurationError,
    ConnectionError,
    LockError,
    LockNotHeldError,
    PgLeaderLockError,
    ServerRefusedError,
    SessionNotDedicatedError,
)
from ..models import Event, LockState, LockStatistics, RetryContext
from ..retry import RetryStrategy, ask
from . import effects as fx  # the results it matches, the effects it asks for: fx.Sleep
from .effects import Call, Effect, Log, LogLevel, Op, Request, Result
from .failing import FailingStreak
from .table import Action, Conditions, IllegalTransitionError, Input, Transition, step

__all__ = ["NON_RETRYABLE", "Machine", "describe", "is_permanent"]

S = LockState
A = Action
I = Input  # noqa: E741

NON_RETRYABLE: tuple[type[Exception], ...] = (
    SessionNotDedicatedError,
    ConfigurationError,
    ServerRefusedError,
)
"""Errors after which retrying cannot help: the lock reports them (``on_error``) and
stops, and ``wait_for_leadership()`` raises them. ``retry_permanent_errors=True`` keeps
retrying [`ServerRefusedError`][pgleaderlock.ServerRefusedError] (a password being
rotated, a database a migration will create)."""


def is_permanent(error: BaseException | None, config: LockConfig | None = None) -> bool:
    """Whether a lock stops on ``error`` instead of retrying (`NON_RETRYABLE`, unless
    ``config.retry_permanent_errors`` keeps a refused connection retrying): the one rule,
    for locks, the Coordinator and the command line."""
    if not isinstance(error, NON_RETRYABLE):
        return False
    return not (
        isinstance(error, ServerRefusedError)
        and config is not None
        and config.retry_permanent_errors
    )


def describe(error: BaseException | None) -> str:
    """``TypeName: message``, passwords masked, for logs."""
    if error is None:
        return "none"
    return mask_dsn(f"{type(error).__name__}: {error}")


_LEADING = frozenset({S.LEADER, S.RECONNECTING, S.RELEASING})

_CONFIRMING = frozenset({I.ACQUIRE_SUCCEEDED, I.REACQUIRE_SUCCEEDED, I.HEALTH_OK})
"""Inputs that confirm that this session holds the lock (``confirmed_at``)."""

PROBE_GRID_S = 0.1
"""Probe times are rounded down to a grid of this step (at most a tenth of
``health_interval_s``): the random phases keep N leaders' probes spread over the
interval, ~N/50 of them per step with the defaults, while the probes of one step share
the event loop's wake-ups. Rounding down keeps every probe within its interval."""


@functools.lru_cache(maxsize=16)
def _conditions(
    auto_reacquire: bool, grace_enabled: bool, step_down: bool, stop_reported: bool
) -> Conditions:
    """One `Conditions` per combination (there are 16), shared."""
    return Conditions(auto_reacquire, grace_enabled, step_down, stop_reported)


_REQUEST_FLAGS = {
    Request.STOP: "_stop",
    Request.RELEASE: "_release",
    Request.FORCE: "_force",
    Request.ALARM: "_alarm",
    Request.DRAINED: "_drained",
    Request.WORK: "_work",
}
"""Where the machine records each request until it acts on it."""


def probe_time(due: float, interval_s: float) -> float:
    """``due`` rounded down to the probe grid (`PROBE_GRID_S`)."""
    grid = min(PROBE_GRID_S, interval_s / 10)
    return math.floor(due / grid) * grid


class Machine:
    """The decision engine of one lock (see the module docstring).

    Args:
        config: the settings decisions depend on.
        retry: asked for every delay; a strategy that raises or returns `None` gives up.
    """

    def __init__(
        self, config: LockConfig, retry: RetryStrategy, rng: random.Random | None = None
    ) -> None:
        self.config = config
        self.retry = retry
        self._rng = rng or random.Random()
        self._state = S.STOPPED
        self._out: list[Effect] = []
        self._now = 0.0
        self._blocked = False  # the effects so far end in a blocking one
        # Requests, recorded until the next decision.
        self._stop = self._release = self._force = self._alarm = False
        self._work = False  # calls are queued for the leader's session (Request.WORK)
        self._release_waiting = False  # someone awaits the end of a step_down()
        self._step_down = False  # the release in flight was asked for by step_down()
        # The session, as far as decisions go.
        self._has_session = False
        self._can_wait = False
        self._call: Call | None = None  # the call whose outcome is awaited
        # Retry policy.
        self._attempt = 0
        self._cycle_start: float | None = None
        self._attempt_at = 0.0
        self._wait_budget_s = 0.0
        self._last_error: Exception | None = None
        self._give_up_reason: tuple[LogLevel, str] = ("info", "")
        self._fatal_error: Exception | None = None
        self._term: int | None = None  # fencing: the term of the current leadership
        self._probe_pending = False  # a late probe is still in flight
        self._announce_at: float | None = None  # fencing: on_acquired after acquire_delay_s
        # A graceful stop's drain (drain_s): until when, whether the callbacks returned,
        # and whether it is over (it runs once per leadership).
        self._drain_until: float | None = None
        self._drained = self._drain_over = False
        # LEADER and RECONNECTING schedules.
        self._probe_at = 0.0
        self._grace_start = 0.0
        self._grace_deadline = 0.0
        self._reconnect_at = 0.0
        self._reconnect_attempt = 0
        # Statistics.
        self._transitions = self._acquisitions = self._losses = self._releases = 0
        self._failed_attempts = self._errors = self._probes = 0
        self._leader_since: float | None = None
        # Health: when the next step is due at the latest, when the leadership was last
        # confirmed, and the errors that keep the lock from leading.
        self._due: float | None = None
        self._confirmed_at: float | None = None
        self._failing = FailingStreak(config.escalate_after_s)

    # ------------------------------------------------------------------ observation

    @property
    def state(self) -> LockState:
        """The current state (only this class assigns it)."""
        return self._state

    @property
    def term(self) -> int | None:
        """The fencing term of the current leadership (``None`` when not LEADER)."""
        return self._term if self._state is S.LEADER else None

    @property
    def draining(self) -> bool:
        """A graceful stop's drain is on: leader work should finish its unit."""
        return self._state is S.LEADER and self._drain_until is not None and not self._drain_over

    @property
    def fatal_error(self) -> Exception | None:
        """The error that stopped the last run for good (retrying could not mend it)."""
        return self._fatal_error

    @property
    def last_error(self) -> Exception | None:
        """The last database error (cleared when leadership begins)."""
        return self._last_error

    def statistics(self, *, leader_since: float | None, backend_pid: int | None) -> LockStatistics:
        """The counters, with the two facts only the runner knows (wall clock, pid)."""
        return LockStatistics(
            state=self._state,
            transitions=self._transitions,
            acquisitions=self._acquisitions,
            losses=self._losses,
            releases=self._releases,
            failed_attempts=self._failed_attempts,
            errors=self._errors,
            last_error=self._last_error,
            leader_since=leader_since if self._state is S.LEADER else None,
            backend_pid=backend_pid,
            term=self.term,
            probes=self._probes,
        )

    @property
    def leader_since(self) -> float | None:
        """Monotonic time at which the current leadership began, or None."""
        return self._leader_since if self._state is S.LEADER else None

    @property
    def due(self) -> float | None:
        """Monotonic time by which the lifecycle task takes its next step at the latest:
        the end of the sleep it was told to take, or the bound of the call it performs
        (callbacks run before either, so slow callbacks make it late). ``None`` when
        stopped. A task still waiting well past it is wedged (a blocked event loop)."""
        return self._due if self._state is not S.STOPPED else None

    @property
    def confirmed_at(self) -> float | None:
        """Monotonic time at which the current leadership was last confirmed (granted,
        or a probe answered), or None when not LEADER."""
        return self._confirmed_at if self._state is S.LEADER else None

    @property
    def failing_since(self) -> float | None:
        """Monotonic time at which the current run of errors that keep the lock from
        leading began (no attempt reached the server since), or None."""
        return self._failing.since

    def preempted(self, call: Call) -> bool:
        """True if a request that may cut `call` short came before it started."""
        return call.interruptible is not None and self._pending(call.interruptible)

    def requested(self, request: Request) -> bool:
        """A request of this kind is recorded and not yet acted on."""
        return self._pending(request)

    # ------------------------------------------------------------------ requests

    def request(self, request: Request) -> bool:
        """Record a request; the machine acts on it at its next decision.

        Args:
            request: what was asked for.

        Returns:
            For [`RELEASE`][pgleaderlock.core.machine.Request.RELEASE]: True if there is
                leadership to release (the caller then waits for
                [`ReleaseDone`][pgleaderlock.core.machine.ReleaseDone]), False when not
                leading. True otherwise.
        """
        match request:
            case Request.STOP:
                self._stop = True  # also before the task's first decision; cleared at STOPPED
            case Request.RELEASE:
                if self._state not in _LEADING:
                    return False
                if self._state is not S.RELEASING:
                    self._release = True
                self._release_waiting = True
            case Request.FORCE:
                self._force = self._state in _LEADING
            case Request.ALARM:
                self._alarm = self._state is S.LEADER
            case Request.DRAINED:
                self._drained = self.draining
            case Request.WORK:
                self._work = self._state is S.LEADER
                return self._work
        return True

    def _pending(self, request: Request) -> bool:
        return bool(getattr(self, _REQUEST_FLAGS[request]))

    # ------------------------------------------------------------------ results

    def handle(self, result: Result, now: float) -> list[Effect]:
        """Take what happened at `now` (monotonic seconds); return what to do next.

        Args:
            result: the outcome of the last blocking effect, or
                [`Started`][pgleaderlock.core.machine.Started] /
                [`Aborted`][pgleaderlock.core.machine.Aborted].
            now: `time.monotonic()` when it happened.

        Returns:
            The [effects][pgleaderlock.core.machine.Effect] to perform, in order; the
                blocking one (if any) is last.

        Raises:
            IllegalTransitionError: a result that makes no sense in the current state
                (a bug in the runner).
        """
        self._out, self._now, self._blocked = [], now, False
        self._due = None
        call, self._call = self._call, None
        match result:
            case fx.Started():
                self._reset_run()
                self._fire(I.START)
            case fx.Aborted(error=error, stop_reported=reported):
                if error is not None:
                    self._log("error", "lifecycle_task_failed", exc=error, error=repr(error))
                    self._emit(Event.ERROR, error=error)
                self._fire(I.TASK_ABORTED, stop_reported=reported)
                return self._out
            case fx.Woke():
                pass
            case fx.Late(acknowledged=acked) if call is not None and call.op is Op.PROBE:
                if acked:  # the server has our probe: slow, not lost; await the answer
                    self._call, self._probe_pending = call, True
                    self._fire(I.PROBE_LATE)
                else:  # a silent network (or no way to tell): lost at the bound
                    self._last_error = ConnectionError(
                        f"health check timed out after {self.config.health_timeout_s:g} s "
                        "and the server has not acknowledged it"
                    )
                    self._fire(I.HEALTH_FAILED)
            case _:
                if call is None:
                    raise IllegalTransitionError(f"{result!r} without a call in flight")
                self._on_outcome(call, result)
        self._decide()
        return self._out

    def _on_outcome(self, call: Call, result: Result) -> None:
        """Map the outcome of ``call`` onto the table's inputs (or onto nothing, when the
        next decision covers it: a connect that succeeded, a call a request cut short)."""
        if call.op is Op.PROBE:
            self._probe_pending = False
        if isinstance(result, fx.CutShort):
            if call.op is Op.UNLOCK:
                self._last_error = ConnectionError(
                    "step_down timed out; closing the session to release the lock"
                )
                self._fire(I.RELEASE_FAILED)
            return  # a stop: the next decision sees it
        if isinstance(result, fx.Failed):
            self._last_error = result.error
        if call.op is Op.CONNECT:
            if isinstance(result, fx.Connected):
                self._has_session, self._can_wait = True, result.can_wait
            elif isinstance(result, fx.Failed):
                self._fire(I.RECONNECT_FAILED if self._state is S.RECONNECTING else I.DB_ERROR)
            return
        value = result.value if isinstance(result, fx.Answered) else None
        match call.op, self._state:
            case ((Op.TRY_LOCK | Op.WAIT_LOCK), S.ACQUIRING):
                self._on_attempt(value, I.DB_ERROR, I.ACQUIRE_SUCCEEDED, I.ACQUIRE_FAILED)
            case Op.TRY_LOCK, S.RECONNECTING:
                self._on_attempt(
                    value, I.RECONNECT_FAILED, I.REACQUIRE_SUCCEEDED, I.REACQUIRE_FAILED
                )
            case ((Op.BUMP_TERM | Op.END_FENCED), (S.ACQUIRING | S.RECONNECTING)):
                self._on_fencing(result)
            case Op.PROBE, (S.LEADER | S.RECONNECTING):
                self._probes += value is not None
                if value is False:
                    self._last_error = LockNotHeldError(
                        "the health probe found that this session no longer holds the lock"
                    )
                self._fire(I.HEALTH_OK if value else I.HEALTH_FAILED)
            case Op.WORK, S.LEADER:  # as a probe: the session answers, or is lost
                self._fire(I.HEALTH_OK if value else I.HEALTH_FAILED)
            case Op.UNLOCK, S.RELEASING:
                if value is None:
                    self._fire(I.DB_ERROR)
                elif value:
                    self._fire(I.RELEASE_SUCCEEDED)
                else:
                    self._last_error = LockError(
                        "pg_advisory_unlock returned false: this session did not hold the lock"
                    )
                    self._fire(I.RELEASE_FAILED)
            case _:
                raise IllegalTransitionError(f"{result!r} of {call.op.name} in {self._state.name}")

    def _on_attempt(self, value: bool | None, failed: Input, granted: Input, held: Input) -> None:
        """The answer of a lock attempt: ``failed`` on an error (``value`` None),
        ``granted`` once the lock is ours, ``held`` when another session holds it."""
        if value is None:
            self._fire(failed)
        elif value:
            self._granted(granted)
        else:
            self._last_error = None  # held by another session: not an error
            self._fire(held)

    def _on_fencing(self, result: Result) -> None:
        """The outcome of a term bump, or of ending the fenced transactions that
        blocked it."""
        acquiring = self._state is S.ACQUIRING
        match result:
            case fx.TermBumped(term=term):
                self._term = term
                self._log("info", "term_bumped", term=term)
                delay = self.config.acquire_delay_s
                if acquiring and delay > 0:
                    self._announce_at = self._now + delay  # the next decision sleeps
                else:
                    self._fire(I.ACQUIRE_SUCCEEDED if acquiring else I.REACQUIRE_SUCCEEDED)
            case fx.TermBlocked():
                # Fenced transactions of an older term still hold the row after the
                # grace: a frozen or cut-off old leader's. End their sessions (fencing
                # rolls those transactions back anyway), then bump again.
                self._log("warning", "term_bump_blocked", grace_s=self.config.fencing_grace_s)
                self._block(Call(Op.END_FENCED, self.config.command_timeout_s,
                                 interruptible=Request.STOP, what=Op.END_FENCED.value))  # fmt: skip
            case fx.FencedEnded(sessions=sessions):
                if sessions.ended:
                    self._log("warning", "fenced_sessions_ended", pids=list(sessions.ended))
                if sessions.refused:
                    self._log("error", "fenced_sessions_not_ended",
                              sessions=[f"{pid} ({role})" for pid, role in sessions.refused],
                              reason="this role may not end them: that takes their role, or "
                              "pg_signal_backend; the new term waits for them")  # fmt: skip
                self._bump_term()
            case _:
                self._fire(I.DB_ERROR if acquiring else I.RECONNECT_FAILED)

    def _granted(self, input_: Input) -> None:
        """The lock was granted: with fencing, bump the term before announcing it (the
        table's input comes once the term is known, and ``acquire_delay_s`` later)."""
        if self.config.term_table is None:
            self._fire(input_)
            return
        self._bump_term()

    def _bump_term(self) -> None:
        """Bump the term, waiting at most ``fencing_grace_s`` for the fenced transactions
        of older terms (then ``TermBlocked``: their sessions are ended, and it tries
        again)."""
        config = self.config
        grace = config.fencing_grace_s
        self._block(Call(Op.BUMP_TERM, grace + config.command_timeout_s, wait_s=grace,
                         interruptible=Request.STOP, what="fencing term"))  # fmt: skip

    # ------------------------------------------------------------------ decisions

    def _decide(self) -> None:
        """Pick the next blocking effect, acting on pending requests first."""
        while not self._blocked:
            state, now = self._state, self._now
            if state is S.STOPPED:
                return
            if self._probe_pending:
                self._decide_reconnecting()
                continue
            stopping = self._stop or (self._release and state in (S.LEADER, S.RECONNECTING))
            if stopping and (state is not S.LEADER or not self._drain_first()):
                self._fire(I.STOP_REQUESTED if self._stop else I.RELEASE_REQUESTED)
                continue
            match state:
                case S.FOLLOWER:
                    if now < self._attempt_at:
                        self._block(fx.Sleep(self._attempt_at))
                    elif not self._has_session:
                        self._connect(self._connect_bound, "connect")
                    else:
                        self._fire(I.ACQUIRE_ATTEMPT)
                case S.LEADER:
                    if self._alarm or now >= self._probe_at:
                        if self._alarm:
                            self._log("debug", "session_alarm")
                        self._alarm = False
                        # A probe that is late demotes at health_timeout_s (the partition
                        # bound) but may still answer: it is then awaited up to
                        # tcp_user_timeout_s, after which the server would have dropped a
                        # silent session anyway. A late "yes, same backend" means the
                        # session was alive all along: the machine was slow, not the lock lost.
                        config = self.config
                        self._block(Call(Op.PROBE, config.tcp_user_timeout_s,
                                         soft_timeout_s=config.health_timeout_s,
                                         what="health check"))  # fmt: skip
                    elif self._work:
                        self._work = False
                        bound = self.config.command_timeout_s  # each queued call has its own
                        # A stop cuts short queued calls (dropping the session), unless it
                        # is to drain first: the drain's work needs them (each is bounded).
                        cut = None if self.config.drain_s > 0 else Request.STOP
                        self._block(Call(Op.WORK, bound, interruptible=cut))
                    else:
                        self._out.append(fx.WatchSession())
                        wake = self._probe_at
                        if self.draining:
                            wake = min(wake, cast(float, self._drain_until))
                        self._block(fx.Sleep(wake))
                case S.RECONNECTING:
                    self._decide_reconnecting()
                case S.ACQUIRING if self._announce_at is not None:
                    if now < self._announce_at:
                        self._block(fx.Sleep(self._announce_at))  # acquire_delay_s
                    else:
                        self._announce_at = None
                        self._fire(I.ACQUIRE_SUCCEEDED)
                case S.ACQUIRING | S.RELEASING:  # pragma: no cover - their rows block
                    raise IllegalTransitionError(f"{state.name} without a call in flight")

    def _drain_first(self) -> bool:
        """A graceful stop of a leader: True while its drain (``drain_s``) goes on. The
        drain starts here, and ends when its callbacks have returned, at its deadline, or
        when a timed-out ``step_down()`` forces the release."""
        if self.config.drain_s <= 0 or self._drain_over:
            return False
        if self._drain_until is None:
            self._fire(I.DRAIN_REQUESTED)
            return True
        if self._drained or self._force or self._now >= self._drain_until:
            self._end_drain()
            return False
        return True

    def _end_drain(self) -> None:
        if self.draining:
            self._drain_over = True
            self._log("info", "drain_ended", drained=self._drained)
            self._out.append(fx.EndDrain())

    def _decide_reconnecting(self) -> None:
        if self._probe_pending:  # a request cuts the late probe short (then acted on)
            self._block(fx.Await(frozenset({Request.STOP, Request.RELEASE})))
            return
        remaining = self._grace_deadline - self._now
        if remaining <= 0:
            self._fire(I.GRACE_EXPIRED)
        elif self._now < self._reconnect_at:
            self._block(fx.Sleep(min(self._reconnect_at, self._grace_deadline)))
        elif not self._has_session:
            self._connect(min(self._connect_bound, remaining), "reconnect")
        else:
            timeout = min(self.config.command_timeout_s, remaining)
            self._block(Call(Op.TRY_LOCK, timeout, interruptible=Request.STOP, what="reconnect"))

    @property
    def _connect_bound(self) -> float:
        return self.config.connect_budget_s or self.config.connect_timeout_s

    def _connect(self, timeout_s: float, what: str) -> None:
        self._block(Call(Op.CONNECT, timeout_s, interruptible=Request.STOP, what=what))

    def _block(self, effect: Call | fx.Await | fx.Sleep) -> None:
        self._out.append(effect)
        self._blocked = True
        match effect:
            case Call(timeout_s=timeout_s):
                self._call = effect
                self._due = self._now + timeout_s
            case fx.Sleep(until=until):
                self._due = until
            case fx.Await():  # a late call: at most its whole bound from now
                self._due = self._now + (self._call.timeout_s if self._call else 0.0)

    # ------------------------------------------------------------------ transitions

    def _conditions(self, stop_reported: bool = True) -> Conditions:
        return _conditions(
            self.config.auto_reacquire,
            self.config.reconnect_grace_s is not None,
            self._step_down and not self._stop,
            stop_reported,
        )

    def _fire(self, input_: Input, *, stop_reported: bool = True) -> None:
        source = self._state
        transition = step(source, input_, self._conditions(stop_reported))
        self._log("debug", "input", input=input_.value, state=source.value)
        if source is S.LEADER and transition.target is not S.LEADER:
            # Leader work stops first: queued session work fails, leader tasks are
            # cancelled, so that the state-change callbacks (which await that work) never
            # wait for a call that only the session's close, after them, would fail.
            self._out.append(fx.StopLeaderWork())
            self._end_drain()  # its callbacks end before anything else is told
            self._drain_until, self._drained, self._drain_over = None, False, False
        if transition.changes_state:
            self._state = transition.target
            self._transitions += 1
            self._leader_since = self._now if transition.target is S.LEADER else None
            fields = (("from", source.value), ("to", self._state.value))
            self._out.append(Log("info", "state_change", fields))
            self._emit(Event.STATE_CHANGE, old=source, new=transition.target)
        if transition.target is S.LEADER and input_ in _CONFIRMING:
            self._confirmed_at = self._now
        if source is S.RELEASING:
            self._step_down = False
        if source is S.ACQUIRING:
            self._announce_at = None
        for action in transition.actions:
            self._act(action, transition)
        if self._state is S.STOPPED:
            self._stop = False
        if self._state is not S.LEADER:
            self._work = False  # what was queued failed on leaving LEADER (StopLeaderWork)
        if self._state not in _LEADING:
            self._release = self._force = self._alarm = False
            if self._release_waiting:
                self._release_waiting = False
                self._out.append(fx.ReleaseDone())

    def _act(self, action: Action, transition: Transition) -> None:
        now, config = self._now, self.config
        match action:
            case A.CLOSE_SESSION:
                if self._has_session:
                    self._has_session = False
                    self._out.append(fx.CloseSession())
            case A.TRY_LOCK:
                if self._cycle_start is None:
                    self._cycle_start = now
                wait_s, self._wait_budget_s = self._wait_budget_s, 0.0
                if wait_s > 0 and self._can_wait:
                    self._block(Call(Op.WAIT_LOCK, wait_s + config.command_timeout_s,
                                     wait_s=wait_s, interruptible=Request.STOP,
                                     abort_on_interrupt=False, what="try_lock"))  # fmt: skip
                else:
                    self._block(Call(Op.TRY_LOCK, config.command_timeout_s,
                                     interruptible=Request.STOP, what="try_lock"))  # fmt: skip
            case A.UNLOCK:
                self._step_down = transition.input is I.RELEASE_REQUESTED and not self._stop
                self._release = False
                self._block(Call(Op.UNLOCK, config.command_timeout_s,
                                 interruptible=Request.FORCE, what="unlock"))  # fmt: skip
            case A.START_HEALTH_LOOP:
                interval = config.health_interval_s
                if transition.source is not S.LEADER:
                    # A new leadership starts its probes at a random phase, so that many
                    # locks that lead from the same moment never probe in one burst.
                    interval *= self._rng.uniform(0.1, 1.0)
                self._probe_at = probe_time(now + interval, config.health_interval_s)
            case A.START_GRACE:
                assert config.reconnect_grace_s is not None
                self._grace_start = now
                self._grace_deadline = now + config.reconnect_grace_s
                self._reconnect_at = now
                self._reconnect_attempt = 0
            case A.RETRY_RECONNECT:
                self._reconnect_attempt += 1
                error = self._last_error
                self._log("info", "reconnect_failed", error=describe(error),
                          attempt=self._reconnect_attempt)  # fmt: skip
                ctx = RetryContext(self._reconnect_attempt, now - self._grace_start, error)
                delay = self._next_delay(ctx)
                if delay is None:
                    self._fire(I.GRACE_EXPIRED)
                else:
                    self._reconnect_at = now + delay
            case A.SCHEDULE_ATTEMPT:
                if not self._gave_up():
                    self._attempt_at, self._wait_budget_s = now, 0.0
            case A.BACKOFF:
                self._backoff()
            case A.RESET_RETRY:
                self._attempt, self._cycle_start, self._last_error = 0, None, None
                self._end_failing()
            case A.LOG_SESSION_LOST:
                self._log("warning", "health_check_failed", error=describe(self._last_error))
            case A.LOG_PROBE_LATE:
                self._log("warning", "probe_late", timeout_s=config.health_timeout_s)
            case A.LOG_RECOVERED:
                self._log("info", "leadership_recovered")
            case A.LOG_GIVING_UP:
                level, reason = self._give_up_reason
                self._log(level, "giving_up", reason=reason)
            case A.EMIT_ACQUIRED:
                self._acquisitions += 1
                self._log("info", "lock_acquired", attempt=self._attempt + 1)
                self._emit(Event.ACQUIRED)
            case A.EMIT_ACQUIRE_FAILED:
                self._failed_attempts += 1
                self._end_failing()  # the attempt reached the server: another session leads
                self._emit(Event.ACQUIRE_FAILED, attempt=self._attempt + 1)
            case A.EMIT_LOST:
                self._losses += 1
                self._log("warning", "lock_lost")
                self._emit(Event.LOST)
            case A.EMIT_RELEASED:
                self._releases += 1
                self._log("info", "lock_released")
                self._emit(Event.RELEASED)
            case A.EMIT_ERROR:
                self._errors += 1
                error = self._last_error or PgLeaderLockError("unknown error")
                self._log_error(error, transition.source)
                self._emit(Event.ERROR, error=error)
            case A.EMIT_STOPPED:
                self._log("info", "lock_stopped")
                self._emit(Event.STOPPED)
            case A.START_DRAIN:
                self._drain_until = now + config.drain_s
                self._log("info", "draining", drain_s=config.drain_s)
                self._out.append(fx.StartDrain())

    def _log_error(self, error: Exception, source: LockState) -> None:
        """``db_error``; errors that keep the lock from leading escalate instead of
        repeating (`FailingStreak`)."""
        text = describe(error)
        if source not in (S.FOLLOWER, S.ACQUIRING):
            self._log("error", "db_error", error=text, state=source.value)
            return
        line = self._failing.error(error, text, self._now)
        fields = dict(line.fields)
        if line.message == "db_error":
            fields = {"error": text, "state": source.value, **fields}
        self._out.append(Log(line.level, line.message, tuple(fields.items())))

    def _end_failing(self) -> None:
        line = self._failing.end(self._now)
        if line is not None:
            self._out.append(Log(line.level, line.message, line.fields))

    # ------------------------------------------------------------------ retry policy

    def _backoff(self) -> None:
        """Count the failed attempt, ask the strategy, schedule the next attempt: a wait
        on the server when the lock was merely taken (wait mode), else a sleep."""
        now = self._now
        self._attempt += 1
        self._wait_budget_s = 0.0
        if self._cycle_start is None:
            self._cycle_start = now
        if self._gave_up():
            return
        error = self._last_error
        delay = self._next_delay(RetryContext(self._attempt, now - self._cycle_start, error))
        if delay is None:
            self._give_up("info", "the retry strategy returned None")
            return
        waiting = self.config.follower_mode == "wait" and self._can_wait and self._has_session
        if error is None and waiting:
            # The lock is taken: spend the delay waiting on the server, so that the lock
            # is ours the instant its holder's session ends. A failed connection sleeps,
            # and so does a stepped-down leader, whose session was just closed.
            self._log("debug", "wait_scheduled", wait_s=round(delay, 3), attempt=self._attempt)
            self._wait_budget_s, self._attempt_at = delay, now
            return
        self._log("debug", "retry_scheduled", delay_s=round(delay, 3), attempt=self._attempt)
        self._attempt_at = now + delay

    def _gave_up(self) -> bool:
        """Give up after an error that retrying cannot mend (NON_RETRYABLE)."""
        error = self._last_error
        if error is None or not is_permanent(error, self.config):
            return False
        self._fatal_error = error
        self._give_up("error", f"non-retryable error: {describe(error)}")
        return True

    def _give_up(self, level: LogLevel, reason: str) -> None:
        self._give_up_reason = (level, reason)
        self._fire(I.RETRIES_EXHAUSTED)

    def _next_delay(self, ctx: RetryContext) -> float | None:
        """Ask the retry strategy; one that raises gives up, like one returning None."""
        try:
            return ask(self.retry, ctx)
        except Exception as exc:
            self._log("error", "retry_strategy_failed", exc=exc, error=repr(exc))
            return None

    # ------------------------------------------------------------------ helpers

    def _reset_run(self) -> None:
        """A new run of the lifecycle task (``start()``, perhaps after a stop). A stop
        requested before the run's first decision is kept."""
        self._release = self._force = self._alarm = self._work = False
        self._release_waiting = self._step_down = False
        self._has_session = self._can_wait = False
        self._attempt, self._cycle_start, self._last_error = 0, None, None
        self._fatal_error = None
        self._term = self._announce_at = None
        self._probe_pending = False
        self._drain_until, self._drained, self._drain_over = None, False, False
        self._wait_budget_s = 0.0
        self._confirmed_at = None
        self._failing = FailingStreak(self.config.escalate_after_s)

    def _emit(
        self,
        event: Event,
        *,
        old: LockState | None = None,
        new: LockState | None = None,
        error: Exception | None = None,
        attempt: int | None = None,
    ) -> None:
        """Run ``event``'s callbacks; while a session holds the lock, with keep-alives
        for its lease (slow callbacks must not cost the lock)."""
        holding = self._has_session and self._state in (S.LEADER, S.RELEASING)
        keepalive = self.config.health_interval_s if holding and self.config.lease_s else None
        self._out.append(fx.Emit(event, old, new, error, attempt, keepalive))

    def _log(self, level: LogLevel, message: str, /, exc: BaseException | None = None,
             **fields: object) -> None:  # fmt: skip
        self._out.append(Log(level, message, tuple(fields.items()), exc))
