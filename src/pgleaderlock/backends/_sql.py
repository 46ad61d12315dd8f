"""SQL shared by every backend, and the checks on what it returns.

Every statement also returns ``pg_backend_pid()``: a session whose server backend
changes between statements is behind a transaction-mode pooler, where a session-level
advisory lock is held by whichever server connection ran the statement. Such a
session is refused (:class:`~pgleaderlock.SessionNotDedicatedError`).
"""

from __future__ import annotations

from ..core.errors import SessionNotDedicatedError

__all__ = [
    "HOLDS",
    "TRY_LOCK",
    "UNLOCK",
    "WAIT_LOCK",
    "check_pid",
    "lock_timeout_ms",
    "oid",
]

# Keys are parenthesised: "-2147483648::int4" parses as -(2147483648::int4) and overflows.
TRY_LOCK = "SELECT pg_try_advisory_lock(({k1})::int4, ({k2})::int4), pg_backend_pid()"
UNLOCK = "SELECT pg_advisory_unlock(({k1})::int4, ({k2})::int4), pg_backend_pid()"
# One round trip: the lock_timeout is local to this statement's implicit transaction and
# is set before pg_advisory_lock starts waiting (the target list runs left to right).
# A timeout raises lock_not_available (SQLSTATE 55P03).
WAIT_LOCK = (
    "SELECT set_config('lock_timeout', '{ms}', true),"
    " pg_advisory_lock(({k1})::int4, ({k2})::int4), pg_backend_pid()"
)
LOCK_NOT_AVAILABLE = "55P03"

CANCEL_TIMEOUT_S = 1.0
"""How long an interrupted lock wait may spend asking the server to cancel it (so the
queued backend leaves the queue at once) before the connection is simply dropped."""
# Two-int4 advisory locks show up in pg_locks as classid=key1, objid=key2, objsubid=2,
# both as oid (unsigned): negative keys are passed already converted by oid().
HOLDS = (
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
    " AND classid = {c}::int8::oid AND objid = {o}::int8::oid AND objsubid = 2),"
    " pg_backend_pid()"
)


def lock_timeout_ms(timeout_s: float) -> int:
    """``lock_timeout`` in ms for a wait of ``timeout_s``; never 0 (0 disables it)."""
    return max(1, round(timeout_s * 1000))


def oid(key: int) -> int:
    """The unsigned 32-bit value that ``pg_locks`` shows for an int4 key."""
    return key & 0xFFFFFFFF


def check_pid(expected: int | None, got: int) -> None:
    """Raise if the statement ran on another server backend than the session's own."""
    if expected is not None and got != expected:
        raise SessionNotDedicatedError(
            f"the session moved from server backend {expected} to {got} between "
            "statements: a transaction-mode pooler (e.g. PgBouncer pool_mode=transaction) "
            "sits between this client and PostgreSQL. Session-level advisory locks need a "
            "direct connection or a session-mode pooler"
        )
