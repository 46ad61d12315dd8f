"""The decision engine: turns results and requests into table inputs (`Machine`). The
state it reads and writes is `state.py`'s; the rows' actions are performed in
`transitions.py`; the table is `table.py`, the effects `effects.py`, the run of errors
`failing.py`, which errors end a run `faults.py`.
"""

from __future__ import annotations

from typing import cast

from ..errors import ConnectionError, LockError, LockNotHeldError
from ..models import Event, LockState
from ..timeline import timeline_change
from . import effects as fx  # the results it matches, the effects it asks for: fx.Sleep
from .effects import Call, Effect, Op, Request, Result
from .faults import NON_RETRYABLE, describe, is_permanent, looks_down
from .table import IllegalTransitionError, Input
from .transitions import Transitions

__all__ = ["NON_RETRYABLE", "Machine", "describe", "is_permanent"]

S = LockState
I = Input  # noqa: E741


class Machine(Transitions):
    """The decision engine of one lock (see the package docstring).

    Args:
        config: the settings decisions depend on.
        retry: asked for every delay; a strategy that raises or returns `None` gives up.
    """

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
            if not looks_down(result.error, self._now - self._call_at, call.timeout_s):
                self._down_since = None
            elif self._down_since is None:
                self._down_since = self._now
        elif isinstance(result, fx.Answered):
            self._down_since = None  # the server answered
        if call.op is Op.CONNECT:
            if isinstance(result, fx.Connected):
                self._down_since = None
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
            case fx.TermBumped(term=term, prior=prior, prior_at=prior_at):
                self._term = term
                self._log("info", "term_bumped", term=term)
                changed = timeline_change(term, prior, prior_at, self._seen_term)
                if changed is not None:  # a failover: what may have been lost, once
                    self._log("warning", "timeline_changed", None, **changed)
                self._seen_term = max(term, self._seen_term or 0)
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
