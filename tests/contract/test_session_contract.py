"""The ``LockSession`` contract, the same on every backend, against a real server: the
capabilities, the calls on a lock, the session's identity and settings, and waits on the
server for a lock (``wait_lock``: timeouts, cancellation, order). Sessions that fail:
test_session_failures.py.

These call the adapters the way the core does (``Backend.connect``, then the session's
methods under ``asyncio.timeout``), one level below ``LeaderLock``. They run on the
in-memory ``FakeServer`` too (the ``fake`` flavour), except where marked
``postgres_only``. Shared helpers: ``support/sessions.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock import ConnectionError
from pgleaderlock.backends import ConnectOptions, LockSession, WaitingSession, WatchableSession
from support.fixture_types import LockPids
from support.poll import eventually
from support.server import Admin
from support.sessions import (
    assert_granted_once,
    equals,
    holder_and_waiter,
    in_slices,
    is_builtin,
    negated,
    sorted_equals,
)

if TYPE_CHECKING:
    from contract.conftest import Target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_builtin_backends_have_every_capability(target: Target) -> None:
    if not is_builtin(target):
        pytest.skip("optional for third-party backends (and the fake)")
    session = await target.session()
    assert isinstance(session, WaitingSession)
    assert isinstance(session, WatchableSession)


async def test_try_lock_unlock_holds(
    target: Target, keys: tuple[int, int], holders: LockPids
) -> None:
    a = await target.session()
    b = await target.session()
    assert await a.try_lock(*keys) is True
    pid = a.backend_pid
    assert pid is not None
    assert await holders(*keys) == [pid]
    assert await b.try_lock(*keys) is False
    assert await a.holds(*keys) is True
    assert await b.holds(*keys) is False
    assert await b.unlock(*keys) is False  # b never held it (the server warns, no error)
    assert await a.unlock(*keys) is True
    assert await holders(*keys) == []
    assert await a.holds(*keys) is False
    assert await a.unlock(*keys) is False


@pytest.mark.postgres_only("asks pg_stat_activity about the session's server process")
async def test_backend_pid_is_the_sessions_client_backend(
    target: Target, keys: tuple[int, int], admin: Admin
) -> None:
    a = await target.session()
    assert await a.try_lock(*keys) is True
    pid = a.backend_pid
    assert pid is not None
    cur = await admin.execute("SELECT backend_type FROM pg_stat_activity WHERE pid = %s", (pid,))
    assert await cur.fetchone() == ("client backend",)
    assert await a.unlock(*keys) is True


async def test_negative_and_extreme_keys(target: Target, holders: LockPids) -> None:
    """Regression: "-2147483648::int4" parses as -(2147483648::int4) and overflowed."""
    session = await target.session()
    for keys in [(-(2**31), 2**31 - 1), (2**31 - 1, -(2**31)), (-1, -1), (0, 0)]:
        assert await session.try_lock(*keys)
        assert await holders(*keys) == [session.backend_pid]
        assert await session.holds(*keys)
        assert await session.unlock(*keys)


@pytest.mark.postgres_only("application_name and settings live on the server")
async def test_application_name_and_server_settings(
    target: Target, admin: Admin, run_sql: Callable[[object, str], Awaitable[tuple[Any, ...]]]
) -> None:
    options = ConnectOptions(
        application_name=f"pgleaderlock-settings-{target.id}",
        connect_timeout_s=3,
        server_settings={
            "tcp_user_timeout": "8750",
            "tcp_keepalives_idle": "4",
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": "6",
            "client_connection_check_interval": "500",
        },
    )
    session = await target.session(options)
    assert await session.try_lock(1, 2)  # the pid is known after the first statement
    await session.unlock(1, 2)
    cur = await admin.execute(
        "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (session.backend_pid,)
    )
    assert await cur.fetchone() == (options.application_name,)
    row = await run_sql(
        session,
        "SELECT current_setting('tcp_user_timeout'), current_setting('tcp_keepalives_idle'),"
        " current_setting('tcp_keepalives_count'),"
        " current_setting('client_connection_check_interval'), inet_client_addr() IS NULL",
    )
    user_timeout, idle, count, check_interval, unix_socket = row
    assert check_interval == "500ms"
    if not unix_socket:  # over TCP the keepalive settings are in force
        assert (user_timeout, idle, count) == ("8750", "4", "6")


async def test_wait_lock_times_out_then_is_granted(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    waiters: LockPids,
) -> None:
    a, b = await holder_and_waiter(target, keys)
    in_slices(b)
    assert await b.try_lock(*keys) is False  # as the core does: try first, then wait
    started = time.monotonic()
    async with asyncio.timeout(5):
        assert await b.wait_lock(*keys, 0.2) is False  # lock_timeout: not an error
    assert time.monotonic() - started > 0.15  # it waited (the bound above is the hang guard)
    assert await waiters(*keys) == []
    wait = asyncio.ensure_future(b.wait_lock(*keys, 30))
    try:
        await eventually(lambda: equals(waiters(*keys), [b.backend_pid]), 5, "b to queue")
        assert await a.unlock(*keys)
        async with asyncio.timeout(5):  # granted on the unlock (the bound is the hang guard)
            assert await wait is True
    finally:
        wait.cancel()
        await asyncio.gather(wait, return_exceptions=True)
    assert await holders(*keys) == [b.backend_pid]
    assert await b.holds(*keys)
    assert await b.try_lock(*keys)  # the session still works after a granted wait
    assert await b.unlock(*keys)
    assert await b.unlock(*keys)  # re-entrant on the server: two holds, two unlocks


async def _waiting_behind(target: Target, keys: tuple[int, int]) -> tuple[LockSession, Any]:
    """A built-in session holding the lock, and one whose wait for it goes on on the
    server after a ``wait_lock()`` that returned False (skips for other backends, whose
    contract allows a wait per call)."""
    if not is_builtin(target):
        pytest.skip("built-in backends only: the contract allows a wait per call")
    a, b = await target.session(), await target.session()
    assert await a.try_lock(*keys)
    assert isinstance(b, WaitingSession)
    assert await b.wait_lock(*keys, 0.1) is False
    assert b.backend_pid is not None
    return a, b


async def test_a_wait_goes_on_across_calls_and_keeps_its_place(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    waiters: LockPids,
) -> None:
    """On a direct connection to PostgreSQL 14 or later, a built-in session's wait goes
    on on the server after ``wait_lock()`` returns False, with no ``lock_timeout`` (each
    expiry writes an ERROR into the server's log): a session that waited first is
    granted the lock first, even if it was between two calls then, and counts that
    grant once."""
    if not is_builtin(target):
        pytest.skip("built-in backends only: the contract allows a wait per call")
    a, b, c = await target.session(), await target.session(), await target.session()
    assert isinstance(b, WaitingSession)
    assert isinstance(c, WaitingSession)
    assert await a.try_lock(*keys)
    assert await b.try_lock(*keys) is False
    assert await b.wait_lock(*keys, 0.1) is False
    # still queued on the server (a loaded machine may be slow to send the wait)
    await eventually(lambda: equals(waiters(*keys), [b.backend_pid]), 5, "b to queue")
    late = asyncio.ensure_future(c.wait_lock(*keys, 30))
    try:
        both = sorted([b.backend_pid or 0, c.backend_pid or 0])
        await eventually(lambda: sorted_equals(waiters(*keys), both), 5, "c to queue")
        assert await a.unlock(*keys)
        await eventually(lambda: equals(holders(*keys), [b.backend_pid]), 5, "b to be granted")
        async with asyncio.timeout(5):
            assert await b.wait_lock(*keys, 1.0) is True
        assert await b.holds(*keys)
        assert await b.unlock(*keys)  # one unlock frees it: the grant counted once
        async with asyncio.timeout(5):
            assert await late is True
        assert await holders(*keys) == [c.backend_pid]
    finally:
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)


async def test_try_lock_during_a_wait_asks_the_wait(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    waiters: LockPids,
) -> None:
    """``try_lock()`` for the lock a wait goes on for answers from that wait (it would
    otherwise need the session the wait occupies)."""
    a, b = await _waiting_behind(target, keys)
    assert await b.try_lock(*keys) is False
    await eventually(lambda: equals(waiters(*keys), [b.backend_pid]), 5, "b to queue")
    assert await a.unlock(*keys)
    await eventually(lambda: equals(holders(*keys), [b.backend_pid]), 5, "b to be granted")
    # Granted on the server; the client reads the grant when its loop gets to it (on a
    # busy machine, a while after the server's lock table shows it).
    await eventually(lambda: b.try_lock(*keys), 5, "b's wait to answer True")
    assert await b.unlock(*keys)
    assert await holders(*keys) == []


async def test_another_call_during_a_wait_drops_the_session(
    target: Target,
    keys: tuple[int, int],
    waiters: LockPids,
    backend_alive: Callable[[int], Awaitable[bool]],
) -> None:
    """Any other statement, or a wait for another lock, cannot tell the wait in flight
    from a grant on its way: the session is dropped (``ConnectionError``, as for a
    broken connection) and its wait leaves the server's queue."""
    a, b = await _waiting_behind(target, keys)
    pid = b.backend_pid
    with pytest.raises(ConnectionError, match="waiting for a lock"):
        await b.holds(*keys)
    await eventually(lambda: equals(waiters(*keys), []), 2, "the wait to leave the queue")
    await eventually(lambda: negated(backend_alive(pid)), 2, "the waiter's backend to go")
    assert await a.holds(*keys)  # the holder's session is untouched


async def test_a_close_cut_short_during_a_wait_still_drops_the_session(
    target: Target,
    keys: tuple[int, int],
    backend_alive: Callable[[int], Awaitable[bool]],
) -> None:
    """``close()`` first cancels the wait in flight; cancelled meanwhile (a shutdown
    that cancels the task closing it), it still drops the connection, never leaves it
    open for the garbage collector."""
    _, b = await _waiting_behind(target, keys)
    pid = b.backend_pid
    closing = asyncio.ensure_future(b.close())
    await asyncio.sleep(0)  # close() is under way: it waits for the wait's cancellation
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    await eventually(lambda: negated(backend_alive(pid)), 2, "the waiter's backend to go")


async def _lock_on_the_driver_connection(session: LockSession, keys: tuple[int, int]) -> None:
    """``pg_advisory_lock`` run on the session's own driver connection, past the session."""
    conn: Any = getattr(session, "connection", None)
    if conn is None:
        pytest.skip(f"{type(session).__name__} does not show its driver connection")
    if hasattr(conn, "fetchrow"):  # asyncpg
        await conn.execute("SELECT pg_advisory_lock($1, $2)", *keys)
    else:
        await conn.execute("SELECT pg_advisory_lock(%s, %s)", keys)


@pytest.mark.postgres_only("runs SQL on the session's driver connection")
async def test_a_wait_granted_as_its_timeout_fired_counts_once(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
) -> None:
    """The server may grant a wait at the instant its lock_timeout fires: the statement
    fails (the wait "timed out") and the session-level lock stays. The session's next
    lock call counts that lock as granted once: not refused, not granted a second time
    (one unlock must free it)."""
    a, b = await holder_and_waiter(target, keys)
    in_slices(b)  # a wait that goes on across calls has no timeout to race with
    assert await b.wait_lock(*keys, 0.1) is False
    assert await a.unlock(*keys)
    await _lock_on_the_driver_connection(b, keys)  # the grant the timeout hid
    await assert_granted_once(a, b, keys, holders)


async def test_waits_after_a_timed_out_wait_count_each_grant_once(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
) -> None:
    """After a wait that timed out, the next lock call first checks whether the lock
    became the session's own: with another session holding it, the session waits again
    (and takes nothing); once it is free, the session is granted it once (one unlock
    frees it), as after any wait."""
    a, b = await holder_and_waiter(target, keys)
    assert await b.wait_lock(*keys, 0.1) is False
    assert await b.wait_lock(*keys, 0.1) is False  # still another's: waited, took nothing
    assert await b.try_lock(*keys) is False
    assert await holders(*keys) == [a.backend_pid]
    assert await b.wait_lock(*keys, 0.1) is False
    assert await a.unlock(*keys)  # free before b's next call
    await assert_granted_once(a, b, keys, holders)


async def test_freed_lock_goes_to_the_first_waiter(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    waiters: LockPids,
) -> None:
    """Waiters are granted in the order they queued, one at a time."""
    await target.require(WaitingSession)
    a, b, c = [await target.session() for _ in range(3)]
    assert isinstance(b, WaitingSession)
    assert isinstance(c, WaitingSession)
    assert await a.try_lock(*keys)
    assert await b.try_lock(*keys) is False
    assert await c.try_lock(*keys) is False
    wait_b = asyncio.ensure_future(b.wait_lock(*keys, 30))
    wait_c: asyncio.Future[bool] | None = None
    try:
        await eventually(lambda: equals(waiters(*keys), [b.backend_pid]), 5, "b to queue")
        wait_c = asyncio.ensure_future(c.wait_lock(*keys, 30))
        assert b.backend_pid is not None
        assert c.backend_pid is not None
        expected = sorted([b.backend_pid, c.backend_pid])
        await eventually(lambda: sorted_equals(waiters(*keys), expected), 5, "c to queue")
        assert await a.unlock(*keys)
        async with asyncio.timeout(5):
            assert await wait_b is True
        assert await holders(*keys) == [b.backend_pid]
        assert await waiters(*keys) == [c.backend_pid]
        assert not wait_c.done()
        assert await b.unlock(*keys)
        async with asyncio.timeout(5):
            assert await wait_c is True
        assert await holders(*keys) == [c.backend_pid]
        assert await c.unlock(*keys)
    finally:
        for wait in (wait_b, wait_c):
            if wait is not None:
                wait.cancel()
                await asyncio.gather(wait, return_exceptions=True)


async def test_cancelled_wait_returns_at_once_and_leaves_no_waiter(
    target: Target,
    keys: tuple[int, int],
    waiters: LockPids,
    backend_alive: Callable[[int], Awaitable[bool]],
) -> None:
    _holder, b = await holder_and_waiter(target, keys)
    assert await b.try_lock(*keys) is False
    pid = b.backend_pid
    assert pid is not None
    wait = asyncio.ensure_future(b.wait_lock(*keys, 30))
    await eventually(lambda: equals(waiters(*keys), [pid]), 5, "b to queue")
    started = time.monotonic()
    wait.cancel()
    await asyncio.gather(wait, return_exceptions=True)
    assert wait.cancelled()
    assert time.monotonic() - started < 0.5
    # Cancelled on the server, not left queued until its lock_timeout
    # (0.5 s) notices the closed socket.
    await eventually(lambda: equals(waiters(*keys), []), 0.3, "the wait to be cancelled")
    await b.close()
    await eventually(lambda: negated(backend_alive(pid)), 0.3, "the waiter's backend to go")
