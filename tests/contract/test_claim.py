"""The claim: a lock granted by a wait on the server is ended soon unless claimed.

A follower queued on the server is granted the lock when the holder leaves, whether or
not its client reads the answer then. The grant carries a short ``idle_session_timeout``
(``ConnectOptions.claim_s``) until the session has read it and claimed the lock (the
lease replaces the short bound), which it does at once, whenever its caller asks next. A
grant nobody reads (the event loop blocked, the process stopped) ends the session within
``claim_s``, and the next waiter is granted the lock; a claimed grant keeps the lease.

Built-in backends only: a third-party session may wait per call, where no grant comes
while nobody asks. The process-level fault (a stopped follower first in the queue) is
``tests/faults/test_frozen_next_in_line.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import psycopg
import pytest

from pgleaderlock import ConnectionError
from pgleaderlock.backends import BaseSession, ConnectOptions, LockSession, WaitingSession
from support.fixture_types import LockPids
from support.poll import eventually

if TYPE_CHECKING:
    from contract.conftest import Target

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.postgres_only("the fake waits per call: no grant comes while nobody asks"),
]

CLAIM_S = 0.5
LEASE_S = 6.0
OPTIONS = ConnectOptions("pgleaderlock-contract-claim", 3.0, lease_s=LEASE_S, claim_s=CLAIM_S)


def _builtin(target: Target) -> None:
    if target.flavour.backend not in ("psycopg", "asyncpg", "sqlalchemy"):
        pytest.skip("built-in backends only: the contract allows a wait per call")


def _in_slices(session: LockSession) -> None:
    """Wait as behind a pooler or on PostgreSQL 13: one wait per call, under a
    ``lock_timeout``."""
    inner = getattr(session, "_inner", session)
    assert isinstance(inner, BaseSession)
    inner._can_wait_on = False


async def _eq(awaitable: Awaitable[object], expected: object) -> bool:
    return await awaitable == expected


class SyncSession:
    """A plain psycopg connection used from a thread of its own (this test's event loop
    is blocked meanwhile): it holds the lock and lets it go when told to, or queues for
    it and notes when the server granted it."""

    def __init__(self, dsn: str, keys: tuple[int, int]) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
        self._keys = keys
        self._thread: threading.Thread | None = None
        self.pid = self._conn.info.backend_pid
        self.granted_at: float | None = None

    def hold(self) -> None:
        self._conn.execute("SELECT pg_advisory_lock(%s, %s)", self._keys)

    def release_in(self, delay_s: float) -> None:
        def release() -> None:
            time.sleep(delay_s)
            self._conn.execute("SELECT pg_advisory_unlock(%s, %s)", self._keys)

        self._start(release)

    def queue(self) -> None:
        def wait() -> None:
            self._conn.execute("SELECT pg_advisory_lock(%s, %s)", self._keys)
            self.granted_at = time.monotonic()

        self._start(wait)

    def _start(self, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=target, name="sync-session")
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(30)
        self._conn.close()


async def test_a_grant_is_claimed_when_it_is_read_whoever_asks_later(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    waiters: LockPids,
) -> None:
    """The session claims a grant as soon as it reads it, not when its caller next asks:
    ``b``'s ``wait_lock()`` returned False, the wait went on on the server and was
    granted while the caller was elsewhere for longer than the claim (its event loop
    running): ``b`` keeps the lock, and its next call says so."""
    _builtin(target)
    a, b = await target.session(OPTIONS), await target.session(OPTIONS)
    assert isinstance(b, WaitingSession)
    assert await a.try_lock(*keys)
    assert await b.wait_lock(*keys, 0.1) is False
    await eventually(lambda: _eq(waiters(*keys), [b.backend_pid]), 5, "b to queue")
    assert await a.unlock(*keys)
    await asyncio.sleep(CLAIM_S + 1.0)  # the caller is elsewhere; the loop runs
    assert await holders(*keys) == [b.backend_pid]
    async with asyncio.timeout(5):
        assert await b.wait_lock(*keys, 1.0) is True
    assert await b.holds(*keys)
    assert await b.unlock(*keys)


@pytest.mark.parametrize("waits", ["across calls", "in slices"])
async def test_a_grant_that_lands_while_the_loop_is_blocked_goes_to_the_next_waiter(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    waiters: LockPids,
    waits: str,
) -> None:
    """``b`` waits first, ``c`` (another client) behind it; the holder leaves while
    ``b``'s event loop is blocked (a synchronous call) for longer than the claim: the
    server grants ``b``, ends its session ``claim_s`` later, and grants ``c``, well
    before ``b``'s lease would have run out, all while ``b``'s loop is blocked. Once it
    runs again, ``b``'s ``wait_lock()`` raises instead of returning True for a lock it
    no longer holds."""
    _builtin(target)
    b = await target.session(OPTIONS)
    assert isinstance(b, WaitingSession)
    if waits == "in slices":
        _in_slices(b)
    holder, behind = SyncSession(target.pg_dsn, keys), SyncSession(target.pg_dsn, keys)
    try:
        holder.hold()
        wait = asyncio.ensure_future(b.wait_lock(*keys, 20))
        await eventually(lambda: _eq(waiters(*keys), [b.backend_pid]), 5, "b to queue")
        behind.queue()
        both = sorted([b.backend_pid or 0, behind.pid])
        await eventually(lambda: _eq(_sorted(waiters(*keys)), both), 5, "c to queue")
        holder.release_in(0.2)
        blocked = time.monotonic()
        time.sleep(CLAIM_S + 1.3)  # the blocked event loop under test
        with pytest.raises(ConnectionError, match="claimed it"):
            async with asyncio.timeout(10):
                await wait
        assert behind.granted_at is not None, "c was not granted while b's loop was blocked"
        waited = behind.granted_at - blocked - 0.2
        assert CLAIM_S * 0.9 <= waited < LEASE_S, f"c was granted {waited:.3f} s after the release"
        assert await holders(*keys) == [behind.pid]
    finally:
        holder.close()
        behind.close()


async def test_a_claimed_grant_keeps_the_lease(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    waiters: LockPids,
) -> None:
    """Once ``wait_lock()`` returned True the session carries the lease, not the claim:
    idle for longer than the claim, it keeps the lock."""
    _builtin(target)
    a, b = await target.session(OPTIONS), await target.session(OPTIONS)
    assert isinstance(b, WaitingSession)
    assert await a.try_lock(*keys)
    wait = asyncio.ensure_future(b.wait_lock(*keys, 20))
    await eventually(lambda: _eq(waiters(*keys), [b.backend_pid]), 5, "b to queue")
    assert await a.unlock(*keys)
    async with asyncio.timeout(10):
        assert await wait is True
    await asyncio.sleep(CLAIM_S + 1.0)  # kept: the behaviour under test, past the claim's end
    assert await holders(*keys) == [b.backend_pid]
    assert await b.holds(*keys)
    assert await b.unlock(*keys)


async def _sorted(awaitable: Awaitable[list[int]]) -> list[int]:
    return sorted(await awaitable)
