"""Value types shared by the core: states, events, statistics, retry context, callbacks."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Callback",
    "ErrorCallback",
    "Event",
    "LeaderChangedCallback",
    "LockState",
    "LockStatistics",
    "RetryContext",
    "StateChangeCallback",
]


class LockState(enum.Enum):
    """The six states of a [`LeaderLock`][pgleaderlock.LeaderLock]."""

    STOPPED = "stopped"
    """Initial and terminal: no lifecycle task, no connection."""
    FOLLOWER = "follower"
    """Running, not holding the lock, waiting for the next acquisition attempt."""
    ACQUIRING = "acquiring"
    """An acquisition attempt is in flight."""
    LEADER = "leader"
    """The lock is held; the health loop runs."""
    RECONNECTING = "reconnecting"
    """Flap damping: the session died, the lock is NOT held, a silent re-acquire runs."""
    RELEASING = "releasing"
    """A voluntary release (``pg_advisory_unlock``) is in flight."""


class Event(enum.Enum):
    """The lifecycle events a lock reports.

    This enum is the one list of events: each member names the decorator that registers a
    callback (``@lock.on_<value>``), the pluggy hook that plugins implement
    (``pgleaderlock_<value>``), the arguments both receive, and says when it happens
    (``description``; the docs' hook table is made from it).
    """

    STATE_CHANGE = "state_change"
    ACQUIRED = "acquired"
    LOST = "lost"
    RELEASED = "released"
    ACQUIRE_FAILED = "acquire_failed"
    ERROR = "error"
    STOPPED = "stopped"
    DRAINING = "draining"
    LEADER_CHANGED = "leader_changed"

    @property
    def description(self) -> str:
        """When the event happens (the hook's and the decorator's documentation)."""
        return _DESCRIPTIONS[self]

    @property
    def decorator(self) -> str:
        """The ``LeaderLock`` method that registers a callback: ``on_<value>``."""
        return f"on_{self.value}"

    @property
    def hook(self) -> str:
        """The pluggy hook name: ``pgleaderlock_<value>``."""
        return f"pgleaderlock_{self.value}"

    @property
    def hook_args(self) -> tuple[str, ...]:
        """What a hook implementation may accept besides ``lock``."""
        return _HOOK_ARGS.get(self, ())

    @property
    def callback_args(self) -> tuple[str, ...]:
        """What a decorator callback is called with (the documented callback types)."""
        return _CALLBACK_ARGS.get(self, ())


_DESCRIPTIONS = {
    Event.STATE_CHANGE: "The state changed (every change, RECONNECTING included).",
    Event.ACQUIRED: "Leadership acquired: this session holds the lock.",
    Event.LOST: "Leadership that was held is lost involuntarily: stop leader-only work now.",
    Event.RELEASED: "Leadership given up voluntarily (`step_down()` or `shutdown()`).",
    Event.ACQUIRE_FAILED: (
        "An attempt found the lock held elsewhere (in wait mode: a wait ended without it)."
    ),
    Event.ERROR: "A database error, or an exception raised by a callback or a plugin.",
    Event.STOPPED: "The lock reached STOPPED.",
    Event.DRAINING: (
        "A graceful stop (`step_down()`, `shutdown()`) begins while LEADER and `drain_s` > 0: "
        "finish the current unit of leader work and return. The lock stays LEADER, and keeps "
        "probing, until every implementation has returned or `drain_s` has passed "
        "(then they are cancelled), and releases the lock after that. Unlike the other "
        "events, these run beside the lock's lifecycle task, not on it."
    ),
    Event.LEADER_CHANGED: (
        "Who leads the lock changed, as seen by every replica (followers and observers "
        "included), with the new `LeaderInfo` (`None`: nobody leads); also once with the "
        "leader first seen. Verified against `pg_locks` (a notification only makes the "
        "replica look). Runs on the process's shared leader watch, not on the lifecycle task."
    ),
}
_HOOK_ARGS = {
    Event.STATE_CHANGE: ("old", "new"),
    Event.ERROR: ("error",),
    Event.ACQUIRE_FAILED: ("attempt",),
    Event.LEADER_CHANGED: ("leader",),
}
_CALLBACK_ARGS = {
    Event.STATE_CHANGE: ("old", "new"),
    Event.ERROR: ("error",),
    Event.LEADER_CHANGED: ("leader",),
}


@dataclass(frozen=True)
class RetryContext:
    """What a [`RetryStrategy`][pgleaderlock.RetryStrategy] is told before each delay.

    Attributes:
        attempt: 1-based number of the attempt that just failed in this cycle.
        elapsed_s: seconds since the first attempt of this cycle.
        last_error: the error of the failed attempt, or ``None`` when the lock was
            simply held by someone else.
        down_for_s: how long the server has looked *down* rather than slow: seconds
            since the first of an unbroken run of failures that came at once (a
            connection refused or closed by every host, a host that is no primary or is
            starting up or shutting down, a session that died), each within a second
            and half the call's bound; ``None`` when the last failure was of another
            kind (a timeout, a server too busy to take the connection) or when nothing
            failed. Such failures are cheap to repeat, and a promoted primary appears at
            any moment: see ``ExponentialBackoff(down_s=...)``.
    """

    attempt: int
    elapsed_s: float
    last_error: Exception | None
    down_for_s: float | None = None


@dataclass(frozen=True)
class LockStatistics:
    """A snapshot of one lock's lifecycle, from
    [`LeaderLock.statistics()`][pgleaderlock.LeaderLock.statistics].

    The counters cover the lock's whole life (restarts included); read two snapshots and
    subtract to get rates.

    Attributes:
        state: the state when the snapshot was taken.
        transitions: changes of state so far.
        acquisitions: times leadership was acquired (``on_acquired``).
        losses: times held leadership was lost involuntarily (``on_lost``).
        releases: times leadership was given up voluntarily (``on_released``).
        failed_attempts: attempts that found the lock held elsewhere
            (``on_acquire_failed``).
        errors: database errors reported through ``on_error`` (callback errors excluded).
        last_error: the last database error, or ``None``.
        leader_since: ``time.time()`` when the current leadership began, or ``None``
            when not LEADER.
        backend_pid: the server pid of the current session, if any.
        term: with ``Fencing(enabled=True)``, the fencing term of the current leadership;
            ``None`` when not LEADER or without fencing.
        probes: health probes the session answered (whatever the answer), over the
            lock's whole life.
        stalled_s: how far the lifecycle task is behind its own schedule: seconds
            since it should have taken its next step at the latest (the end of the
            sleep it took, or the bound of the database call it made) and has not. 0.0
            while on time and when stopped; more than a fraction of a second means a
            blocked event loop or a callback that does not return (a wedged lock:
            [`health.check`][pgleaderlock.health.check]).
        failing_since: ``time.time()`` when the current run of errors that keep the
            lock from leading began (it cannot connect, or its attempts fail, and no
            attempt has reached the server since); ``None`` otherwise. See
            ``escalate_after_s``.
        confirmed_at: ``time.time()`` when this session was last confirmed to hold
            the lock (granted, or a health probe answered); ``None`` when not LEADER.
    """

    state: LockState
    transitions: int
    acquisitions: int
    losses: int
    releases: int
    failed_attempts: int
    errors: int
    last_error: Exception | None
    leader_since: float | None
    backend_pid: int | None
    term: int | None = None
    probes: int = 0
    stalled_s: float = 0.0
    failing_since: float | None = None
    confirmed_at: float | None = None


Callback = Callable[[], None] | Callable[[], Awaitable[None]]
"""An event callback: a plain function or a coroutine function, no arguments."""

StateChangeCallback = (
    Callable[[LockState, LockState], None] | Callable[[LockState, LockState], Awaitable[None]]
)
"""Called with ``(from_state, to_state)`` on every change of state."""

LeaderChangedCallback = Callable[[Any], None] | Callable[[Any], Awaitable[None]]
"""Called with the new [`LeaderInfo`][pgleaderlock.LeaderInfo], or ``None`` when nobody
leads."""

ErrorCallback = Callable[[Exception], None] | Callable[[Exception], Awaitable[None]]
"""Called with the exception of a database error or of a failing callback."""
