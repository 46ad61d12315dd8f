"""What one lock's machine knows: its requests, its session as far as decisions go, its
retry and health schedules, its counters; and the few primitives every decision uses
(block on an effect, log, emit). The decisions themselves live above it: the table's
rows are applied in `transitions.py`, results and requests are decided on in
`engine.py`."""

from __future__ import annotations

import math
import random

from ..config import LockConfig
from ..models import Event, LockState, LockStatistics
from ..retry import RetryStrategy
from . import effects as fx
from .effects import Call, Effect, Log, LogLevel, Op, Request
from .failing import FailingStreak
from .table import Input

__all__ = ["PROBE_GRID_S", "MachineState", "probe_time"]

S = LockState
I = Input  # noqa: E741

_LEADING = frozenset({S.LEADER, S.RECONNECTING, S.RELEASING})

_CONFIRMING = frozenset({I.ACQUIRE_SUCCEEDED, I.REACQUIRE_SUCCEEDED, I.HEALTH_OK})
_FOLLOWING = frozenset({S.FOLLOWER, S.ACQUIRING})
"""A follower's cycle: it tries (or waits on the server), and follows again."""
"""Inputs that confirm that this session holds the lock (``confirmed_at``)."""

PROBE_GRID_S = 0.1
"""Probe times are rounded down to a grid of this step (at most a tenth of
``health_interval_s``): the random phases keep N leaders' probes spread over the
interval, ~N/50 of them per step with the defaults, while the probes of one step share
the event loop's wake-ups. Rounding down keeps every probe within its interval."""


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


class MachineState:
    """The state of one lock's decision engine, and the primitives its decisions use;
    [`Machine`][pgleaderlock.core.machine.Machine] adds the decisions (and documents the
    arguments)."""

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
        self._call_at = 0.0  # when it began
        # Since when every failure came at once (the server looks down), or None.
        self._down_since: float | None = None
        # Retry policy.
        self._attempt = 0
        self._cycle_start: float | None = None
        self._attempt_at = 0.0
        self._wait_budget_s = 0.0
        self._last_error: Exception | None = None
        self._give_up_reason: tuple[LogLevel, str] = ("info", "")
        self._fatal_error: Exception | None = None
        self._term: int | None = None  # fencing: the term of the current leadership
        self._seen_term: int | None = None  # fencing: the last term this lock led under
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
        # A follower's round trips to ACQUIRING and back (each wait on the server, each
        # try) are logged at INFO once, then at DEBUG until the lock leaves that cycle.
        self._following_logged = False
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
                self._call, self._call_at = effect, self._now
                self._due = self._now + timeout_s
            case fx.Sleep(until=until):
                self._due = until
            case fx.Await():  # a late call: at most its whole bound from now
                self._due = self._now + (self._call.timeout_s if self._call else 0.0)

    # ------------------------------------------------------------------ helpers

    def _reset_run(self) -> None:
        """A new run of the lifecycle task (``start()``, perhaps after a stop). A stop
        requested before the run's first decision is kept."""
        self._release = self._force = self._alarm = self._work = False
        self._release_waiting = self._step_down = False
        self._has_session = self._can_wait = False
        self._attempt, self._cycle_start, self._last_error = 0, None, None
        self._down_since = None
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
