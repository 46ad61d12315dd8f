"""Which errors end a lock's run, and how errors are written in logs: the one rule, for
locks, the Coordinator and the command line."""

from __future__ import annotations

from .._logging import mask_dsn
from ..config import LockConfig
from ..errors import (
    ConfigurationError,
    ConnectionError,
    ServerRefusedError,
    SessionNotDedicatedError,
    sqlstate,
)

__all__ = ["NON_RETRYABLE", "QUICK_FAILURE_S", "describe", "is_permanent", "looks_down"]

QUICK_FAILURE_S = 1.0
"""A connection error this fast (and within half the call's bound) came from a server, a
host or a proxy that answered at once: a refused or closed connection, a standby, a
server starting up or shutting down, a session that died. Repeating such an attempt
costs next to nothing; a timeout is another matter (a black hole, an overloaded host)."""

_BUSY = (
    "too many clients",  # PostgreSQL's max_connections (libpq gives no SQLSTATE)
    "remaining connection slots",  # the slots reserved for superusers
    "too many connections",  # a role's or a database's CONNECTION LIMIT
    "no more connections allowed",  # PgBouncer's max_client_conn
)

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


def looks_down(error: BaseException, took_s: float, bound_s: float) -> bool:
    """Whether a failed call says "the server is down" rather than "slow" or "busy": a
    connection error that came within `QUICK_FAILURE_S` and half the call's bound
    ``bound_s``, and not a server too busy to take one more connection (SQLSTATE class
    53, "too many clients", a pooler's "no more connections allowed"), which a fast
    retry would only burden."""
    if not isinstance(error, ConnectionError) or is_permanent(error):
        return False
    if took_s >= min(QUICK_FAILURE_S, bound_s / 2):
        return False
    cause: BaseException | None = error
    while cause is not None:
        code = sqlstate(cause)
        if code is not None and code.startswith("53"):
            return False
        cause = cause.__cause__
    text = str(error).lower()
    return not any(busy in text for busy in _BUSY)


def describe(error: BaseException | None) -> str:
    """``TypeName: message``, passwords masked, for logs."""
    if error is None:
        return "none"
    return mask_dsn(f"{type(error).__name__}: {error}")
