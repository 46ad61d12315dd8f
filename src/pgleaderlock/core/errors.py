"""The exception hierarchy (spec §6.1). Every error the library raises derives from
[`PgLeaderLockError`][pgleaderlock.PgLeaderLockError].

``ConnectionError`` keeps the spec's name and also derives from the builtin
`ConnectionError`, so ``except ConnectionError`` catches it whichever of the two names is in
scope.
"""

from __future__ import annotations

import builtins

__all__ = [
    "BackendUnavailableError",
    "ConfigurationError",
    "ConnectionError",
    "LockError",
    "LockNotHeldError",
    "PgLeaderLockError",
    "SessionNotDedicatedError",
    "ShutdownError",
]


class PgLeaderLockError(Exception):
    """Base exception for all pgleaderlock errors."""


class ConfigurationError(PgLeaderLockError, ValueError):
    """Bad input: keys out of range, non-positive intervals, a malformed DSN, ...

    Raised before any I/O, by constructors and factories.
    """


class ConnectionError(PgLeaderLockError, builtins.ConnectionError):
    """Failed to establish or maintain a database connection."""


class SessionNotDedicatedError(ConnectionError):
    """The session does not stay on one server backend (e.g. a transaction-mode pooler).

    A session-level advisory lock taken through PgBouncer in transaction mode is held by
    whichever server connection ran that statement, not by this client. The library
    refuses such sessions instead of silently "holding" nothing.
    """


class LockError(PgLeaderLockError):
    """Failed to acquire or release the advisory lock."""


class LockNotHeldError(LockError):
    """The health probe found that this session no longer holds the lock."""


class ShutdownError(PgLeaderLockError):
    """Shutdown did not complete in time; the connection was closed forcibly."""


class BackendUnavailableError(PgLeaderLockError, ImportError):
    """The requested backend is unknown, or its driver is not installed."""


for _cls in (
    PgLeaderLockError,
    ConfigurationError,
    ConnectionError,
    SessionNotDedicatedError,
    LockError,
    LockNotHeldError,
    ShutdownError,
    BackendUnavailableError,
):
    _cls.__module__ = "pgleaderlock"
del _cls
