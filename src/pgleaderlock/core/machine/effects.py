"""What the machine is told (results, requests) and what it asks for (effects).

Plain frozen values: the runner performs an effect and reports its outcome as the next
[`Result`][pgleaderlock.core.machine.Result].
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ..models import Event, LockState
from ..session import FencedSessions

__all__ = [
    "Aborted",
    "Answered",
    "Await",
    "Call",
    "CloseSession",
    "Connected",
    "CutShort",
    "Effect",
    "Emit",
    "EndDrain",
    "Failed",
    "FencedEnded",
    "IdleStep",
    "Late",
    "Log",
    "LogLevel",
    "Op",
    "ReleaseDone",
    "Request",
    "Result",
    "Sleep",
    "StartDrain",
    "Started",
    "StopLeaderWork",
    "TermBlocked",
    "TermBumped",
    "WatchSession",
    "Woke",
    "idle_step",
]


@dataclass(frozen=True)
class Started:
    """[`start()`][pgleaderlock.LeaderLock.start] was called: the lifecycle task runs."""


@dataclass(frozen=True)
class Connected:
    """A new session is open.

    Attributes:
        can_wait: the session can wait on the server
            ([`WaitingSession`][pgleaderlock.backends.WaitingSession]).
    """

    can_wait: bool


@dataclass(frozen=True)
class Answered:
    """The call returned: granted, held, released (True) or not (False).

    Attributes:
        value: the call's answer.
    """

    value: bool


@dataclass(frozen=True)
class Failed:
    """The call raised or timed out.

    Attributes:
        error: what it raised (a timeout as a
            [`ConnectionError`][pgleaderlock.ConnectionError]).
    """

    error: Exception


@dataclass(frozen=True)
class CutShort:
    """A request cut the call short (the session is then unusable)."""


@dataclass(frozen=True)
class Woke:
    """A sleep ended: its deadline passed, or a request woke it."""


@dataclass(frozen=True)
class Late:
    """The call's ``soft_timeout_s`` passed and it has not answered yet; it goes on.

    Attributes:
        acknowledged: the server has acknowledged everything the session sent (the path
            works: slow, not lost); ``None`` when that cannot be told.
    """

    acknowledged: bool | None = None


@dataclass(frozen=True)
class TermBumped:
    """The fencing term was incremented on the lock's session: this is the new term;
    ``prior`` and ``prior_at`` are what the term row held before, on that server
    (``None``: no row, or a session that does not say)."""

    term: int
    prior: int | None = None
    prior_at: dt.datetime | None = None


@dataclass(frozen=True)
class TermBlocked:
    """The term bump waited its ``wait_s`` and fenced transactions of an older term still
    hold the term row: nothing was changed."""


@dataclass(frozen=True)
class FencedEnded:
    """The sessions of the fenced transactions that blocked the term bump were ended
    (those this role may end).

    Attributes:
        sessions: which were ended, which were left alone.
    """

    sessions: FencedSessions


@dataclass(frozen=True)
class Aborted:
    """The lifecycle task was cancelled or crashed.

    Attributes:
        error: the crash, or `None` for a cancellation (a forced shutdown).
        stop_reported: `on_stopped` has already run for this run of the task.
    """

    error: Exception | None
    stop_reported: bool


Result = (
    Started
    | Connected
    | Answered
    | TermBumped
    | TermBlocked
    | FencedEnded
    | Late
    | Failed
    | CutShort
    | Woke
    | Aborted
)
"""What the runner reports to [`Machine.handle`][pgleaderlock.core.machine.Machine.handle]."""


class Request(enum.Enum):
    """What users (and the session watch) ask for, at any moment."""

    STOP = "stop"
    """[`shutdown()`][pgleaderlock.LeaderLock.shutdown] (or the external shutdown event)."""
    RELEASE = "release"
    """[`step_down()`][pgleaderlock.LeaderLock.step_down]."""
    FORCE = "force"
    """`step_down()` timed out: cut the unlock short and close the session."""
    ALARM = "alarm"
    """The idle session's socket became readable: probe now."""
    DRAINED = "drained"
    """Every ``on_draining`` callback has returned: the drain is over."""
    WORK = "work"
    """Calls are queued for the leader's session (a Coordinator's statements on its hold
    session): run them before the next sleep."""


class Op(enum.Enum):
    """The database calls a [`Call`][pgleaderlock.core.machine.Call] performs."""

    CONNECT = "connect"
    """Open a session."""
    TRY_LOCK = "try_lock"
    """[`LockSession.try_lock`][pgleaderlock.LockSession.try_lock]."""
    WAIT_LOCK = "wait_lock"
    """[`WaitingSession.wait_lock`][pgleaderlock.backends.WaitingSession.wait_lock]."""
    PROBE = "health check"
    """[`LockSession.holds`][pgleaderlock.LockSession.holds]: the health probe."""
    UNLOCK = "unlock"
    """[`LockSession.unlock`][pgleaderlock.LockSession.unlock]."""
    BUMP_TERM = "fencing term"
    """``FencingSession.bump_term``, waiting ``wait_s`` for fenced transactions of older
    terms: its outcome is a ``TermBumped``, or a ``TermBlocked``."""
    END_FENCED = "end fenced transactions"
    """``FencingSession.end_fenced``: its outcome is a ``FencedEnded``."""
    WORK = "session work"
    """The calls queued for the leader's session (``Request.WORK``): like a probe, they
    show that the session answers on its own backend; the first that fails loses the
    leadership, as a failed probe does."""


@dataclass(frozen=True)
class Call:
    """Blocking: one database call, bounded by `timeout_s`; its outcome is the next
    result.

    Attributes:
        op: which call.
        timeout_s: its bound.
        wait_s: for [`WAIT_LOCK`][pgleaderlock.core.machine.Op.WAIT_LOCK] and
            [`BUMP_TERM`][pgleaderlock.core.machine.Op.BUMP_TERM]: how long to wait on the
            server.
        interruptible: the request that may cut it short, if any.
        abort_on_interrupt: drop the connection before the call is cancelled; False for
            a server-side wait, which the driver should cancel on the server first.
        what: names the call in errors (`"connect timed out after 5 s"`).
    """

    op: Op
    timeout_s: float
    wait_s: float = 0.0
    interruptible: Request | None = None
    abort_on_interrupt: bool = True
    what: str = ""
    soft_timeout_s: float | None = None


@dataclass(frozen=True)
class Await:
    """Blocking: keep waiting for the call that was reported ``Late``; its outcome is the
    next result. ``interruptible`` requests may now cut it short (the session is
    aborted)."""

    interruptible: frozenset[Request]


@dataclass(frozen=True)
class Sleep:
    """Blocking: wait until `until` (monotonic seconds), or until a request wakes the
    task; the next result is [`Woke`][pgleaderlock.core.machine.Woke].

    Attributes:
        until: the deadline, in `time.monotonic()` seconds.
    """

    until: float


@dataclass(frozen=True)
class Emit:
    """Run the event's callbacks and plugin hooks (in registration order).

    Attributes:
        event: which [`Event`][pgleaderlock.Event].
        old: for `STATE_CHANGE`: the state left.
        new: for `STATE_CHANGE`: the state entered.
        error: for `ERROR`: the database error.
        attempt: for `ACQUIRE_FAILED`: the attempt's number in this cycle.
        keepalive_s: the session holds the lock: while the callbacks run, show the
            server that the client lives this often (a probe whose outcome nobody
            waits for), so that slow callbacks do not cost the lock to its lease;
            ``None``: no session holds the lock.
    """

    event: Event
    old: LockState | None = None
    new: LockState | None = None
    error: Exception | None = None
    attempt: int | None = None
    keepalive_s: float | None = None


LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class Log:
    """Write one structured log record.

    Attributes:
        level: its level.
        message: the event name (the record's `event` field).
        fields: further structured fields.
        exc: an exception whose traceback the record carries.
    """

    level: LogLevel
    message: str
    fields: tuple[tuple[str, object], ...] = ()
    exc: BaseException | None = None


@dataclass(frozen=True)
class CloseSession:
    """Close the session (bounded, never raises); it frees any lock it holds."""


@dataclass(frozen=True)
class StopLeaderWork:
    """The lock leaves LEADER: before anything else is told, fail the calls queued for
    the leader's session ([`Request.WORK`][pgleaderlock.core.machine.Request.WORK]) that
    have not run, and cancel the leader work that follows the lock (``follow_state``'s
    ``leaving``), at once. Leader work may wait for such a call; the state-change
    callbacks then stop that work and await it: were the calls failed only by the
    session's close, after those callbacks, the lock would wait for itself."""


@dataclass(frozen=True)
class WatchSession:
    """Watch the idle session: its socket becoming readable sends
    [`Request.ALARM`][pgleaderlock.core.machine.Request.ALARM]."""


@dataclass(frozen=True)
class StartDrain:
    """A graceful stop begins with a drain: run the ``on_draining`` callbacks beside the
    lifecycle task (they end with [`Request.DRAINED`][pgleaderlock.core.machine.Request])."""


@dataclass(frozen=True)
class EndDrain:
    """The drain is over (done, ``drain_s`` passed, or leadership left): cancel the
    ``on_draining`` callbacks still running, and await them."""


@dataclass(frozen=True)
class ReleaseDone:
    """A pending [`step_down()`][pgleaderlock.LeaderLock.step_down] is over: wake whoever
    waits for it."""


Effect = (
    Call
    | Await
    | Sleep
    | Emit
    | Log
    | CloseSession
    | StopLeaderWork
    | WatchSession
    | ReleaseDone
    | StartDrain
    | EndDrain
)
"""What [`Machine.handle`][pgleaderlock.core.machine.Machine.handle] returns, in order. A
list holds at most one blocking effect ([`Call`][pgleaderlock.core.machine.Call] or
[`Sleep`][pgleaderlock.core.machine.Sleep]), always last; a list
without one means the lock has stopped."""


class IdleStep(NamedTuple):
    """An idle leader's step (see [`idle_step`][pgleaderlock.core.machine.idle_step]); a
    named tuple, made twice per probe of every idle leader.

    Attributes:
        logs: the records to write first.
        watch: watch the session (``WatchSession``) before waiting.
        wait: a [`Sleep`][pgleaderlock.core.machine.Sleep], or the probe: a
            [`Call`][pgleaderlock.core.machine.Call] of ``Op.PROBE`` with a soft timeout.
    """

    logs: tuple[Log, ...]
    watch: bool
    wait: Sleep | Call


def idle_step(effects: list[Effect]) -> IdleStep | None:
    """The contract between the machine and the runner for an idle leader.

    A LEADER that nobody asks for anything sleeps, probes and sleeps again: hundreds of
    times a second with a thousand leaders in one process. For those steps the machine
    asks for nothing but log records, watching the session, and one blocking effect
    that is a [`Sleep`][pgleaderlock.core.machine.Sleep] or a probe (``Op.PROBE``, with a
    soft timeout). Such a list may be performed outside the lifecycle task, in
    event-loop callbacks (the runner's idle loop), and this says whether ``effects`` is
    one, and its parts. Anything else (callbacks, a connect, an unlock, queued work, a
    request's consequences) returns ``None``: the task performs it.
    """
    if not effects:
        return None
    last = effects[-1]
    if not isinstance(last, Sleep) and not (
        isinstance(last, Call) and last.op is Op.PROBE and last.soft_timeout_s is not None
    ):
        return None
    logs: list[Log] = []
    watch = False
    for effect in effects[:-1]:
        if isinstance(effect, Log):
            logs.append(effect)
        elif isinstance(effect, WatchSession):
            watch = True
        else:
            return None
    return IdleStep(tuple(logs), watch, last)
