"""The lock calls, on the session base: ``try_lock`` and ``unlock`` guarded by the
session's token, and the wait on the server (``wait_lock``) that outlives the calls that
started it, with the claim that bounds a grant nobody reads.

[`LockingSession`][pgleaderlock.backends.locking.LockingSession] is built on
[`CheckedSession`][pgleaderlock.backends.checked.CheckedSession];
[`BaseSession`][pgleaderlock.backends.BaseSession] on it. It imports no driver.
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from ..lowlevel import (
    ConnectionError,
    PgLeaderLockError,
    SessionNotDedicatedError,
    UnclaimedGrantError,
)
from .checked import CheckedSession
from .errors import sqlstate
from .sockets import set_keepalive
from .sql import (
    CLAIM,
    FLUSH_STATS,
    LOCK_NOT_AVAILABLE,
    TRY_LOCK,
    UNLOCK,
    WAIT_LOCK,
    Statement,
    lock_timeout_ms,
)

__all__ = ["LockingSession"]

# A follower's wait outlives the call that started it (see BaseSession.wait_lock); its
# TCP session is kept honest by keepalives: a partition is noticed within about 10 s.
_WAIT_KEEPALIVE = (5, 1, 5)


class LockingSession(CheckedSession):
    """The lock calls and the wait of [`BaseSession`][pgleaderlock.backends.BaseSession]
    (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._unsure = False  # the last wait timed out: it may have been granted meanwhile
        # A wait on the server that outlives wait_lock() calls (see there), and its keys.
        self._waiting: asyncio.Task[object] | None = None
        self._waiting_for: tuple[int, int] | None = None
        self._can_wait_on: bool | None = None  # may waits outlive the calls? (known once)

    @property
    def _mode(self) -> int:
        """The lock statements' ``{4}``: 2 after a wait that timed out, 1 behind a
        pooler, else 0."""
        if self._unsure:
            return 2
        return int(self._info is not None and self._info.behind_pooler)

    async def _lock_call(self, statement: Statement, *values: int) -> object:
        """A lock statement, guarded: it runs only on the session's own backend, with
        its token (the session identifies itself first if it has not yet)."""
        info = self._info or await self.identify()
        values = (*values, info.backend_pid, self._token, self._mode, self._lease_ms)
        value = (await self._row(statement, values))[0]
        self._unsure = False
        if value is None and statement is not UNLOCK:
            raise SessionNotDedicatedError(
                f"{statement.what}: this session's server backend ({info.backend_pid}) "
                "already holds the lock it asked for: another client shares the backend "
                "(a pooler in transaction or statement mode)"
            )
        return value

    async def _lock_call_wait(self, key1: int, key2: int, timeout_ms: int) -> object:
        info = self._info or await self.identify()
        granted_ms = self._claim_ms or self._lease_ms  # the idle bound of a grant
        values = (key1, key2, info.backend_pid, self._token, self._mode, granted_ms, timeout_ms)
        row = await self._row(WAIT_LOCK, values)
        self._unsure = False
        if row[1] is None:
            raise SessionNotDedicatedError(
                f"wait_lock: this session's server backend ({info.backend_pid}) already "
                "holds the lock it asked for: another client shares the backend (a pooler "
                "in transaction or statement mode)"
            )
        return row[1]

    async def _claim(self) -> None:
        """A wait was granted the lock, and the session has read the grant: replace the
        claim's short idle bound by the lease ([`CLAIM`][pgleaderlock.backends.CLAIM]).
        Fails with [`UnclaimedGrantError`][pgleaderlock.UnclaimedGrantError] when the
        server ended the session meanwhile (the grant was not read within the claim's
        bound): the lock went to the next waiter."""
        if not self._claim_ms:
            return
        info = self._info or await self.identify()
        try:
            row = await self._abort_if_cut(CLAIM, (info.backend_pid, self._token, self._lease_ms))
        except SessionNotDedicatedError:
            raise
        except ConnectionError as exc:
            raise UnclaimedGrantError(
                f"wait_lock: the lock was granted, but the server ended the session before "
                f"this client claimed it (within {self._claim_ms / 1000:g} s): {exc}"
            ) from exc.__cause__
        if row[0] is None:
            raise SessionNotDedicatedError(
                f"claim: this session's server backend is not {info.backend_pid}: "
                "another client shares the backend (a pooler in transaction or "
                "statement mode)"
            )

    async def _abort_if_cut(
        self, statement: Statement, values: tuple[Any, ...]
    ) -> tuple[object, ...]:
        """`_row` for a statement that runs inside ``wait_lock`` (whose caller cuts it
        short without aborting the session first, so that the wait itself can be
        cancelled on the server): if cut short, the session is dropped at once, before
        the driver sees the cancellation (psycopg would ask the server to cancel a
        statement that has long finished, and wait for that, for seconds)."""
        task = asyncio.ensure_future(self._row(statement, values))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.abort()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise

    async def try_lock(self, key1: int, key2: int) -> bool:
        """``pg_try_advisory_lock(key1, key2)``: True if granted now (by the wait in
        flight for it, if there is one)."""
        if self._waiting is not None and self._waiting_for == (key1, key2):
            return await self.wait_lock(key1, key2, 0.0)
        return bool(await self._lock_call(TRY_LOCK, key1, key2))

    async def unlock(self, key1: int, key2: int) -> bool:
        """``pg_advisory_unlock(key1, key2)``: True if this session held the lock."""
        return bool(await self._lock_call(UNLOCK, key1, key2))

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        """Wait on the server for the lock: True once granted, False after ``timeout_s``.

        On a direct connection to PostgreSQL 14 or later, the wait on the server goes on
        after this returns False: the next call for the same lock waits on, so that a
        follower waits in one piece, with no ``lock_timeout`` (whose every expiry
        writes an ERROR and the statement into the server's log) and no new place in
        the queue. Keepalives on the socket notice a partition meanwhile. Closing the
        session cancels the wait on the server; a wait whose client died without a word
        ends within a second (``client_connection_check_interval``, set when the session
        is set up, unless the server logs lock waits: see ``WAIT_SETTINGS``). Any other
        statement, or a wait for another lock, drops the session first
        (``ConnectionError``): the wait cannot be told apart from a grant in flight.
        Elsewhere (an older server, a pooler, a socket without keepalives) every call is
        one wait under a ``lock_timeout`` of ``timeout_s``.

        A grant sets the claim's short ``idle_session_timeout``
        (``ConnectOptions.claim_s``): the server may grant the lock while nobody reads
        the answer (this process stopped, its event loop blocked). The session claims
        the lock as soon as it reads the grant (the lease replaces the claim's bound),
        before this returns True; a session that reads it too late finds itself ended
        ([`UnclaimedGrantError`][pgleaderlock.UnclaimedGrantError]), and the lock with
        the next waiter.
        """
        if not self._waits_on():
            return await self.wait_lock_once(key1, key2, timeout_s)
        wait = self._waiting
        if wait is not None and self._waiting_for != (key1, key2):
            await self._drop_wait("wait_lock")
        if wait is None:
            if self._info is not None and self._info.shared_stats:
                # no statistics timer to wake the wait
                await self._abort_if_cut(FLUSH_STATS, ())
            wait = self._waiting = asyncio.get_running_loop().create_task(
                self._wait_then_claim(key1, key2)
            )
            self._waiting_for = (key1, key2)
        try:
            done, _ = await asyncio.wait((wait,), timeout=max(0.0, timeout_s))
        except asyncio.CancelledError:  # the caller gives up: so does the server's wait
            await self._cancel_wait()
            self._unsure = True  # granted as the cancel arrived? (see WAIT_LOCK)
            raise
        if not done:
            return False  # still waiting on the server
        self._waiting = self._waiting_for = None
        wait.result()  # the wait's error, if it failed (or its claim's)
        return True

    async def wait_lock_once(self, key1: int, key2: int, timeout_s: float) -> bool:
        """One wait on the server under a ``lock_timeout`` of ``timeout_s``: True once
        granted (and claimed), False when the timeout fired; either way the wait has
        ended on the server. A wait of `wait_lock` in flight drops the session first
        (``ConnectionError``), as any other statement does."""
        if self._waiting is not None:
            await self._drop_wait("wait_lock")
        try:
            await self._lock_call_wait(key1, key2, lock_timeout_ms(timeout_s))
        except PgLeaderLockError as exc:
            if sqlstate(exc.__cause__) == LOCK_NOT_AVAILABLE and not self._closed():
                self._unsure = True  # granted as the timeout fired? (see WAIT_LOCK)
                return False
            raise
        await self._claim()
        return True

    async def _wait_then_claim(self, key1: int, key2: int) -> None:
        """The wait that outlives the calls (no ``lock_timeout``: until granted), then the
        claim, at once: the claim bounds a grant that this process cannot read (stopped,
        its event loop blocked), not one its caller reads late (its lease does)."""
        await self._lock_call_wait(key1, key2, 0)
        await self._claim()

    def _waits_on(self) -> bool:
        """May a wait outlive the calls (see `wait_lock`)? Decided once per session."""
        if self._can_wait_on is None:
            info = self._info
            direct = info is not None and info.lease_supported and not info.behind_pooler
            self._can_wait_on = direct and set_keepalive(self._socket(), *_WAIT_KEEPALIVE)
        return self._can_wait_on

    async def _cancel_wait(self) -> None:
        """Cancel the wait in flight, if any, and wait for it to end: the driver asks
        the server to cancel the statement (bounded by ``CANCEL_TIMEOUT_S``)."""
        wait, self._waiting, self._waiting_for = self._waiting, None, None
        if wait is not None:
            wait.cancel()
            await asyncio.gather(wait, return_exceptions=True)

    async def _drop_wait(self, what: str) -> NoReturn:
        """A wait is in flight on the session and something else was asked of it: drop
        the session (the wait's backend stops within a second) and say so."""
        try:
            await self._cancel_wait()
        finally:
            self.abort()
        raise ConnectionError(f"{what}: the session was waiting for a lock; it was dropped")

    async def _before_statement(self, statement: Statement) -> None:
        """A statement other than the wait's own drops a wait in flight (see
        `wait_lock`)."""
        if self._waiting is not None and statement is not WAIT_LOCK and statement is not CLAIM:
            await self._drop_wait(statement.what)
