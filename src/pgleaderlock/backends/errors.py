"""How driver errors become the library's: by SQLSTATE, and by message for the errors a
server sends before a session exists (authentication, unknown database or role)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..lowlevel import (
    ConfigurationError,
    PgLeaderLockError,
    ServerRefusedError,
    SessionNotDedicatedError,
    mask_dsn,
    sqlstate,
)

__all__ = [
    "CONNECTION_SQLSTATE_CLASSES",
    "REFUSED_SQLSTATES",
    "ErrorClass",
    "by_sqlstate",
    "check_pid",
    "check_target_session_attrs",
    "malformed_dsn",
    "misconfigured_by_message",
    "refused_by_message",
    "sqlstate",
    "translate",
]

ErrorClass = type[PgLeaderLockError]
"""A library error class, as a driver's error table maps to."""


CONNECTION_SQLSTATE_CLASSES = frozenset(
    {"08", "27", "28", "2F", "38", "39", "3B", "40", "53", "54", "55", "57", "58", "F", "H"}
)
"""SQLSTATE classes (two characters, or one for ``F…``/``H…``) that mean "this session
is unusable, or never was": the classes psycopg raises as ``OperationalError``. A
backend that maps them to [`ConnectionError`][pgleaderlock.ConnectionError] and other server
errors to [`LockError`][pgleaderlock.LockError] gives the same library error as every other
backend for the same server error."""

_POOLER = (
    "a transaction-mode pooler (e.g. PgBouncer pool_mode=transaction) sits between this "
    "client and PostgreSQL. Session-level advisory locks need a direct connection or a "
    "session-mode pooler"
)


REFUSED_SQLSTATES: dict[str, ErrorClass] = {
    "28": ServerRefusedError,  # invalid_authorization_specification, invalid_password
    "3D000": ServerRefusedError,  # invalid_catalog_name: the database does not exist
    "42501": ServerRefusedError,  # insufficient_privilege: no CONNECT on the database
}
"""SQLSTATEs that mean the server refused this client at connect time for a reason
that retrying does not mend (a driver's connect may look them up with
[`by_sqlstate`][pgleaderlock.backends.errors.by_sqlstate])."""

_REFUSED = re.compile(
    r"password authentication failed|authentication failed for user"
    r"|role \S+ does not exist|database \S+ does not exist|no pg_hba\.conf entry"
    r"|is not permitted to log in|permission denied for database|no password supplied"
)


_MISCONFIGURED = re.compile(
    r"invalid \S+ value|invalid connection option|invalid integer value|invalid port number"
)


def misconfigured_by_message(message: str) -> bool:
    """For libpq's connect errors: does the message say that a connection option is
    wrong (``invalid sslmode value``, ``invalid connection option``)? That is the
    client's configuration, which retrying does not mend."""
    return _MISCONFIGURED.search(message) is not None


def refused_by_message(message: str) -> bool:
    """For drivers whose connect errors carry no SQLSTATE (libpq's): does the message say
    that the server refused this client for good (see ``REFUSED_SQLSTATES``)? Only the
    server's English messages are recognised; others are treated as retryable."""
    return _REFUSED.search(message) is not None


def malformed_dsn(dsn: str, why: object) -> ConfigurationError:
    """The error for a DSN the backend cannot use: ``malformed DSN '...': why``, with
    every password masked, in the DSN and in ``why`` (a driver's message may quote the
    DSN). Raise it ``from None``: the driver's error would show the DSN unmasked."""
    return ConfigurationError(f"malformed DSN {mask_dsn(dsn)!r}: {mask_dsn(str(why))}")


def check_target_session_attrs(value: object, dsn: str) -> None:
    """Refuse a ``target_session_attrs`` that would let the lock settle on a standby.

    Args:
        value: the DSN's ``target_session_attrs``, or ``None``.
        dsn: the DSN, for the message (its passwords masked there).

    Raises:
        ConfigurationError: anything but ``read-write`` or ``primary``.
    """
    if value is not None and str(value) not in ("read-write", "primary"):
        raise ConfigurationError(
            f"target_session_attrs={value} in {mask_dsn(dsn)!r}: a lock must live on the primary "
            "(a standby's advisory locks do not exclude the primary's); use read-write, "
            "or leave it out (it is added for a multi-host DSN)"
        )


def by_sqlstate(code: str, table: Mapping[str, ErrorClass], default: ErrorClass) -> ErrorClass:
    """Look a SQLSTATE up in a driver's error table: the full code first, then its class
    (two characters), then its first character.

    Args:
        code: the SQLSTATE.
        table: SQLSTATE, class or first character -> library error.
        default: the library error when nothing matches.

    Returns:
        The library error class.
    """
    return table.get(code) or table.get(code[:2]) or table.get(code[:1]) or default


def translate(exc: BaseException, what: str, cls: ErrorClass) -> PgLeaderLockError:
    """The library error ``cls`` for the driver error ``exc``: the shared wording
    (``"<what>: <DriverError>: <first line of its message>"``, any DSN password
    masked), with ``exc`` as the ``__cause__``.

    Args:
        exc: the error the driver raised.
        what: the operation, for the message (``"try_lock"``, ``"connect"``, ...).
        cls: the library error to raise, as the driver's table says.

    Returns:
        The error to raise (``raise translate(...) from exc``).
    """
    text = str(exc).strip()
    message = mask_dsn(text.splitlines()[0] if text else repr(exc))
    if isinstance(exc, TimeoutError) and not text:
        message = "timed out"
    wording = f"{what}: {type(exc).__name__}: {message}"
    if issubclass(cls, SessionNotDedicatedError):
        # A statement of this session's own (a prepared one) is missing, or its name is
        # taken, on the server backend that ran it: another backend than the session's.
        wording += (
            ": the session's prepared statements are not on the server backend that ran "
            f"this one, so {_POOLER}"
        )
    err = cls(wording)
    err.__cause__ = exc
    return err


def check_pid(expected: int | None, got: int) -> None:
    """Raise if the statement ran on another server backend than the session's own.

    Args:
        expected: the session's server pid so far (``None`` before its first statement).
        got: the ``pg_backend_pid()`` the statement returned.

    Raises:
        SessionNotDedicatedError: the two differ.
    """
    if expected is not None and got != expected:
        raise SessionNotDedicatedError(
            f"the session moved from server backend {expected} to {got} between "
            f"statements: {_POOLER}"
        )
