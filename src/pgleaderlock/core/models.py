"""Value types shared by the core: states, inputs, retry context, callback types."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = [
    "Callback",
    "ErrorCallback",
    "Input",
    "LockState",
    "RetryContext",
    "StateChangeCallback",
]


class LockState(enum.Enum):
    """The six states of a :class:`~pgleaderlock.LeaderLock` (spec §3.1)."""

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


class Input(enum.Enum):
    """The inputs (events) that drive the state machine (spec §3.2)."""

    START = "Start"
    STOP_REQUESTED = "StopRequested"
    ACQUIRE_ATTEMPT = "AcquireAttempt"
    ACQUIRE_SUCCEEDED = "AcquireSucceeded"
    ACQUIRE_FAILED = "AcquireFailed"
    DB_ERROR = "DbError"
    HEALTH_OK = "HealthOk"
    HEALTH_FAILED = "HealthFailed"
    REACQUIRE_SUCCEEDED = "ReacquireSucceeded"
    REACQUIRE_FAILED = "ReacquireFailed"
    GRACE_EXPIRED = "GraceExpired"
    RELEASE_REQUESTED = "ReleaseRequested"
    RELEASE_SUCCEEDED = "ReleaseSucceeded"
    RELEASE_FAILED = "ReleaseFailed"


@dataclass(frozen=True)
class RetryContext:
    """What a :class:`~pgleaderlock.RetryStrategy` is told before each delay (spec §4.5).

    Attributes:
        attempt: 1-based number of the attempt that just failed in this cycle.
        elapsed_s: seconds since the first attempt of this cycle.
        last_error: the error of the failed attempt, or ``None`` when the lock was
            simply held by someone else.
    """

    attempt: int
    elapsed_s: float
    last_error: Exception | None


Callback = Callable[[], None] | Callable[[], Awaitable[None]]
"""An event callback: a plain function or a coroutine function, no arguments."""

StateChangeCallback = (
    Callable[[LockState, LockState], None] | Callable[[LockState, LockState], Awaitable[None]]
)
"""Called with ``(from_state, to_state)`` on every change of state."""

ErrorCallback = Callable[[Exception], None] | Callable[[Exception], Awaitable[None]]
"""Called with the exception of a database error or of a failing callback."""
