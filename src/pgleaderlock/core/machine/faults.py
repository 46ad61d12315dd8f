"""Which errors end a lock's run, and how errors are written in logs: the one rule, for
locks, the Coordinator and the command line."""

from __future__ import annotations

from .._logging import mask_dsn
from ..config import LockConfig
from ..errors import ConfigurationError, ServerRefusedError, SessionNotDedicatedError

__all__ = ["NON_RETRYABLE", "describe", "is_permanent"]

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
