"""The exception hierarchy. Every error the library raises derives from
[`PgLeaderLockError`][pgleaderlock.PgLeaderLockError]. Two of them live beside the code
that raises them: ``pgleaderlock.schedule.RunFailed`` (a job raises it to record its run
as failed) and ``pgleaderlock.core.calls.CallInterrupted`` (a lock's call cut short; it
never leaves the lifecycle task).

``ConnectionError`` keeps the name the library has always given it and also derives from
the builtin `ConnectionError`, so ``except ConnectionError`` catches it whichever of the two
names is in scope.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable

__all__ = [
    "BackendUnavailableError",
    "ConfigurationError",
    "ConnectionError",
    "FencedError",
    "HandOverError",
    "LockError",
    "LockNotHeldError",
    "MissingPrivilegeError",
    "PgLeaderLockError",
    "PooledConnectionError",
    "ServerRefusedError",
    "SessionNotDedicatedError",
    "ShutdownError",
    "StandbyError",
    "UnclaimedGrantError",
    "UntrustedObjectError",
    "sqlstate",
]


class PgLeaderLockError(Exception):
    """Base exception for all pgleaderlock errors."""


class ConfigurationError(PgLeaderLockError, ValueError):
    """Bad input: keys out of range, non-positive intervals, a malformed DSN, ...

    Raised before any I/O, by constructors and factories.
    """


class ConnectionError(PgLeaderLockError, builtins.ConnectionError):
    """Failed to establish or maintain a database connection."""


class ServerRefusedError(ConnectionError):
    """The server refused this client for a reason that retrying does not mend:
    authentication failed, or the role or the database does not exist.

    The lock reports it (``on_error``) and stops at once, and
    [`wait_for_leadership`][pgleaderlock.LeaderLock.wait_for_leadership] raises it,
    unless the lock was made with ``retry_permanent_errors=True`` (for a password that
    is being rotated, or a database that a migration will create).
    """


class StandbyError(ConnectionError):
    """The session's server is a standby (``pg_is_in_recovery()``): an advisory lock
    taken there does not exclude a lock taken on the primary, so the lock refuses it.

    Retried: a standby may be promoted. A multi-host DSN makes the driver move on to a
    read-write host (``target_session_attrs=read-write`` is added when absent).
    """


class SessionNotDedicatedError(ConnectionError):
    """The session does not stay on one server backend (e.g. a transaction-mode pooler).

    A session-level advisory lock taken through PgBouncer in transaction mode is held by
    whichever server connection ran that statement, not by this client. The library
    refuses such sessions instead of silently "holding" nothing.
    """


class UnclaimedGrantError(ConnectionError):
    """A wait on the server was granted the lock, but the server ended the session
    before this client claimed the grant: the process did not read the server's answer
    within the claim's bound (it was stopped, its event loop blocked, or it was slower
    than the bound allows). The lock went to the next waiter, if any; this one never
    led, reconnects and waits again, with a longer claim for its next grants. See
    [A frozen next in line](../guarantees.md#a-frozen-next-in-line).
    """


class PooledConnectionError(ConfigurationError):
    """``connect_fn`` returned a connection that belongs to a pool.

    Attributes:
        give_back: hands the connection back to its pool (awaited by the core before
            the error is reported), or ``None``.
    """

    def __init__(self, message: str, give_back: Callable[[], Awaitable[object]] | None = None):
        super().__init__(message)
        self.give_back = give_back


class UntrustedObjectError(ConfigurationError):
    """A table the library would read or write exists, but cannot be trusted: it is not a
    plain table (a view, say), or its owner, or its schema's owner, is not a role the
    session trusts (the session's own role, a superuser, or one named in
    ``trusted_roles``). It is never used: another role's table could run that role's
    code as this session's role (a trigger, a view calling a function). The message says
    who owns what and how to fix it. Not retried."""


class MissingPrivilegeError(ConfigurationError):
    """The session's role lacks a privilege the library needs on its own table or
    schema (and cannot create the table). The message has the ``GRANT`` (or the
    ``CREATE TABLE``) that mends it. Not retried."""


class LockError(PgLeaderLockError):
    """Failed to acquire or release the advisory lock."""


class FencedError(LockError):
    """``fence()`` found that the lock's term has moved on (or that this process does not
    lead): another leader has begun, so this transaction must not commit. Roll it back.
    """


class HandOverError(LockError):
    """[`hand_over(to=...)`][pgleaderlock.LeaderLock.hand_over] cannot hand leadership to
    that replica: this lock does not lead, or the replica is not waiting for the lock
    (or published no row to be found by)."""


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
    ServerRefusedError,
    StandbyError,
    PooledConnectionError,
    LockError,
    FencedError,
    LockNotHeldError,
    ShutdownError,
    BackendUnavailableError,
):
    _cls.__module__ = "pgleaderlock"
del _cls


def sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE a driver error carries (psycopg and asyncpg both call it
    ``sqlstate``), or ``None``. The backends translate driver errors with it; the core
    reads it from a library error's cause (a table gone missing).

    Args:
        exc: a driver error, or anything else.

    Returns:
        The five-character code, or ``None`` for an error the server did not send.
    """
    code = getattr(exc, "sqlstate", None)
    return code if isinstance(code, str) and code else None
