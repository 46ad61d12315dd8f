"""The interface for backend authors, and the built-in driver adapters.

A backend adapts one database driver to the core's [`LockSession`][pgleaderlock.LockSession]
protocol. Everything a backend needs is importable from here; the modules behind these names
are implementation details:

- the contract: [`Backend`][pgleaderlock.Backend] (what the entry point names),
  [`ConnectOptions`][pgleaderlock.ConnectOptions], [`LockSession`][pgleaderlock.LockSession]
  and its optional capabilities [`WaitingSession`][pgleaderlock.backends.WaitingSession],
  [`BoundedWaitSession`][pgleaderlock.backends.BoundedWaitSession],
  [`WatchableSession`][pgleaderlock.backends.WatchableSession],
  [`AbortableSession`][pgleaderlock.backends.AbortableSession],
  [`ProbingSession`][pgleaderlock.backends.ProbingSession],
  [`KeepAliveSession`][pgleaderlock.backends.KeepAliveSession],
  [`TableSession`][pgleaderlock.backends.TableSession],
  [`QuerySession`][pgleaderlock.backends.QuerySession] and
  [`FencingSession`][pgleaderlock.backends.FencingSession] (with
  [`FencedSessions`][pgleaderlock.backends.FencedSessions]);
- the shared base (``pgleaderlock.backends.base``):
  [`BaseSession`][pgleaderlock.backends.BaseSession], which writes the lock calls, the row
  and pid checks and the error translation once over a few driver calls, the statements
  ([`TRY_LOCK`][pgleaderlock.backends.TRY_LOCK], [`UNLOCK`][pgleaderlock.backends.UNLOCK],
  [`WAIT_LOCK`][pgleaderlock.backends.WAIT_LOCK], [`CLAIM`][pgleaderlock.backends.CLAIM],
  [`HOLDS`][pgleaderlock.backends.HOLDS])
  and the helpers they need;
- the errors a backend raises;
- the registry's public functions: [`available`][pgleaderlock.backends.available],
  [`registered`][pgleaderlock.backends.registered], [`get`][pgleaderlock.backends.get],
  [`refresh`][pgleaderlock.backends.refresh]. The registry itself lives in the core
  (``pgleaderlock.core.registry``) and finds every backend, the built-in ones included,
  through the entry-point group ``pgleaderlock.backends``.

The built-in adapters are the submodules ``psycopg``, ``asyncpg`` and ``sqlalchemy``.
Importing this package imports none of them, and no driver.
"""

from __future__ import annotations

from ..lowlevel import (
    AbortableSession,
    Backend,
    BoundedWaitSession,
    ConfigurationError,
    ConnectionError,
    ConnectOptions,
    FencedSessions,
    FencingSession,
    KeepAliveSession,
    LockError,
    LockSession,
    ProbingSession,
    QuerySession,
    SessionNotDedicatedError,
    SocketSession,
    TableSession,
    WaitingSession,
    WatchableSession,
    available,
    get,
    key_to_oid,
    oid_to_key,
    refresh,
    registered,
)
from .base import (
    ALIVE,
    CANCEL_TIMEOUT_S,
    CLAIM,
    CONNECTION_SQLSTATE_CLASSES,
    HOLDS,
    LOCK_NOT_AVAILABLE,
    TRY_LOCK,
    UNLOCK,
    WAIT_LOCK,
    BaseSession,
    ErrorClass,
    Statement,
    by_sqlstate,
    check_pid,
    lock_timeout_ms,
    sqlstate,
    translate,
)

__all__ = [
    "ALIVE",
    "CANCEL_TIMEOUT_S",
    "CLAIM",
    "CONNECTION_SQLSTATE_CLASSES",
    "HOLDS",
    "LOCK_NOT_AVAILABLE",
    "TRY_LOCK",
    "UNLOCK",
    "WAIT_LOCK",
    "AbortableSession",
    "Backend",
    "BaseSession",
    "BoundedWaitSession",
    "ConfigurationError",
    "ConnectOptions",
    "ConnectionError",
    "ErrorClass",
    "FencedSessions",
    "FencingSession",
    "KeepAliveSession",
    "LockError",
    "LockSession",
    "ProbingSession",
    "QuerySession",
    "SessionNotDedicatedError",
    "SocketSession",
    "Statement",
    "TableSession",
    "WaitingSession",
    "WatchableSession",
    "available",
    "by_sqlstate",
    "check_pid",
    "get",
    "key_to_oid",
    "lock_timeout_ms",
    "oid_to_key",
    "refresh",
    "registered",
    "sqlstate",
    "translate",
]
