"""The table's rows applied: `Transitions._fire` asks `table.step` for the row of an
input and is the one place that sets a lock's state; `_act` performs the row's actions
as effects, with the retry policy they use (attempt counting, give-up, the wait budget of
a waiting follower)."""

from __future__ import annotations

import functools

from ..errors import PgLeaderLockError
from ..models import Event, LockState, RetryContext
from ..retry import ask
from . import effects as fx
from .effects import Call, Log, LogLevel, Op, Request
from .faults import describe, is_permanent
from .state import _CONFIRMING, _FOLLOWING, _LEADING, MachineState, probe_time
from .table import Action, Conditions, Input, Transition, step

__all__ = ["Transitions"]

S = LockState
A = Action
I = Input  # noqa: E741


@functools.lru_cache(maxsize=16)
def _conditions(
    auto_reacquire: bool, grace_enabled: bool, step_down: bool, stop_reported: bool
) -> Conditions:
    """One `Conditions` per combination (there are 16), shared."""
    return Conditions(auto_reacquire, grace_enabled, step_down, stop_reported)


class Transitions(MachineState):
    """Applies the table's rows to the lock's `MachineState`."""

    def _end_drain(self) -> None:
        if self.draining:
            self._drain_over = True
            self._log("info", "drain_ended", drained=self._drained)
            self._out.append(fx.EndDrain())

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
            cycle = {source, transition.target} == _FOLLOWING
            quiet = cycle and self._following_logged
            self._following_logged = cycle and (quiet or transition.target is S.FOLLOWER)
            self._out.append(Log("debug" if quiet else "info", "state_change", fields))
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
                ctx = RetryContext(
                    self._reconnect_attempt, now - self._grace_start, error, self._down_for()
                )
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
        down = self._down_for() if error is not None else None
        delay = self._next_delay(RetryContext(self._attempt, now - self._cycle_start, error, down))
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

    def _down_for(self) -> float | None:
        """``RetryContext.down_for_s``: how long every failure has come at once."""
        return None if self._down_since is None else self._now - self._down_since

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
