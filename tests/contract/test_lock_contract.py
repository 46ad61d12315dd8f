"""The behaviour of ``LeaderLock``, the same on every backend, against a real server.

Each test runs once per backend flavour (see ``conftest.py``): the state machine is the
same code on every driver, so any difference here is an adapter bug. The ``fake``
flavour runs them on the in-memory ``FakeServer``, except where marked
``postgres_only``: there a difference is a bug in the fake.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import (
    ConnectionError,
    FixedInterval,
    LeaderLock,
    LockOptions,
    LockState,
    Session,
)
from pgleaderlock.backends import WaitingSession, WatchableSession
from support.fixture_types import LockPids, MakeRecorder, Terminate
from support.poll import eventually
from support.proxy import TcpProxy
from support.server import Admin, one_row
from support.timings import lock_args

if TYPE_CHECKING:
    from contract.conftest import Target

S = LockState
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _not(awaitable: Awaitable[object]) -> bool:
    return not await awaitable


async def _eq(awaitable: Awaitable[object], expected: object) -> bool:
    return await awaitable == expected


async def test_acquire_and_release(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
) -> None:
    lock = target.lock(keys)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    assert lock.is_leader
    assert await holders(*keys) == [lock.backend_pid]
    await lock.step_down()
    assert await holders(*keys) == []
    await lock.shutdown()
    assert lock.state is S.STOPPED
    assert rec.names()[:2] == ["acquired", "released"]
    assert rec.names()[-1] == "stopped"
    assert rec.errors() == []


async def test_extreme_keys(
    target: Target,
    recorder: MakeRecorder,
    holders: LockPids,
) -> None:
    keys = (-(2**31), random.randint(1, 2**31 - 1))
    lock = target.lock(keys)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(5)
    assert await holders(*keys) == [lock.backend_pid]
    await lock.shutdown()
    assert await holders(*keys) == []
    assert rec.errors() == []


async def test_mutual_exclusion_among_five(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
) -> None:
    locks = [target.lock(keys) for _ in range(5)]
    recs = [recorder(lock) for lock in locks]
    try:
        await asyncio.gather(*(lock.start() for lock in locks))
        seen_leaders = set()
        for _ in range(6):
            deadline = time.monotonic() + 10
            while not any(lock.is_leader for lock in locks):
                assert time.monotonic() < deadline, "nobody became leader"
                await asyncio.sleep(0.01)
            for _ in range(5):  # sample: one leader, one holder in pg_locks
                assert sum(lock.is_leader for lock in locks) == 1
                leader = next(lock for lock in locks if lock.is_leader)
                assert await holders(*keys) == [leader.backend_pid]
                await asyncio.sleep(0.02)
            seen_leaders.add(id(leader))
            await leader.step_down()
        assert len(seen_leaders) >= 2
        assert sum(r.names().count("acquired") for r in recs) >= 6
    finally:
        await asyncio.gather(*(lock.shutdown() for lock in locks))
    # A waiter that was granted the lock just as it was told to stop closes its session
    # instead of unlocking: the server frees the lock as that backend exits, a moment
    # later (psycopg does not wait for it, asyncpg does).
    await eventually(lambda: _not(holders(*keys)), 1.0, "the lock to be freed")
    assert all(rec.errors() == [] for rec in recs)


async def test_terminated_leader_is_lost_and_follower_takes_over(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    terminate: Terminate,
) -> None:
    a, b = target.lock(keys), target.lock(keys)
    rec_a, rec_b = recorder(a), recorder(b)
    await rec_b.follow(a, 10)
    old_pid = a.backend_pid
    await terminate(old_pid)
    await rec_a.wait_event("lost", timeout=10)
    assert await b.wait_for_leadership(10)
    assert await holders(*keys) == [b.backend_pid]
    assert b.backend_pid != old_pid
    assert rec_a.names()[:2] == ["acquired", "lost"]
    assert all(isinstance(e, ConnectionError) for e in rec_a.errors())
    await rec_a.wait_event("acquire_failed", timeout=10)  # a rejoined as a follower
    assert not a.is_leader


async def test_step_down_hands_over(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
) -> None:
    a = target.lock(keys, retry_strategy=FixedInterval(0.5))
    b = target.lock(keys)
    rec_a, rec_b = recorder(a), recorder(b)
    await rec_b.follow(a, 10)
    await a.step_down()
    assert rec_a.names() == ["acquired", "released"]
    assert await b.wait_for_leadership(10)
    assert await holders(*keys) == [b.backend_pid]
    assert "acquired" not in rec_a.names()[1:]


async def test_flap_damping_recovers_silently(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    terminate: Terminate,
) -> None:
    lock = target.lock(keys, reconnect_grace_s=10.0)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    old_pid = lock.backend_pid
    await terminate(old_pid)
    await rec.wait(lambda: S.RECONNECTING in rec.states(), timeout=10)
    await rec.wait(lambda: rec.states()[-1] is S.LEADER, timeout=10)
    assert rec.names() == ["acquired"]  # no on_lost, no second on_acquired
    assert lock.backend_pid != old_pid
    assert await holders(*keys) == [lock.backend_pid]


async def test_shutdown_releases_and_closes(
    target: Target,
    keys: tuple[int, int],
    holders: LockPids,
    backend_alive: Callable[[int], Awaitable[bool]],
) -> None:
    # (That this pid carries the lock's application_name: see
    # test_application_name_identifies_the_holder.)
    lock = target.lock(keys)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    pid = lock.backend_pid
    assert pid is not None
    await lock.shutdown()
    assert await holders(*keys) == []  # unlocked before the session was closed
    await eventually(lambda: _not(backend_alive(pid)), 2, "the session to end")


async def test_never_reentrant(target: Target, keys: tuple[int, int], holders: LockPids) -> None:
    """Health probes never re-acquire: after ~100 probes one unlock frees the lock."""
    lock = target.lock(keys, health_interval_s=0.01, auto_reacquire=False)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    pid = lock.backend_pid
    await asyncio.sleep(1.0)  # kept: the behaviour under test, leading through ~100 probes
    assert lock.is_leader
    assert await holders(*keys) == [pid]
    await lock.step_down()  # exactly one pg_advisory_unlock
    assert await holders(*keys) == []
    other = await target.session()  # another session takes it at once
    assert await other.try_lock(*keys) is True
    assert await other.unlock(*keys) is True


@pytest.mark.postgres_only("a TCP proxy between client and server")
async def test_stuck_network_does_not_hang_shutdown(
    target: Target, keys: tuple[int, int], holders: LockPids
) -> None:
    """A leader behind a proxy that stops forwarding: shutdown stays bounded, and the
    lock is freed once the connection is gone."""
    async with TcpProxy(*target.server_address()) as proxy:
        dsn = target.dsn(host="127.0.0.1", port=proxy.port)
        lock = target.lock(keys, dsn=dsn, command_timeout_s=0.5, health_interval_s=5.0)
        await lock.start()
        assert await lock.wait_for_leadership(10)
        proxy.stall()
        started = time.monotonic()
        async with asyncio.timeout(5):
            await lock.shutdown()
        assert time.monotonic() - started < 3
        assert lock.state is S.STOPPED
        await proxy.cut()
        await eventually(lambda: _not(holders(*keys)), 10, "the lock to be freed")


@pytest.mark.postgres_only("a TCP proxy between client and server")
async def test_interrupted_try_lock_never_reuses_the_session(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    """try_lock stuck on the wire times out: that session is closed, not reused."""
    async with TcpProxy(*target.server_address()) as proxy:
        dsn = target.dsn(host="127.0.0.1", port=proxy.port)
        lock = target.lock(keys, dsn=dsn, command_timeout_s=0.3)
        rec = recorder(lock)

        @lock.on_state_change
        def stall_on_first_attempt(old: LockState, new: LockState) -> None:
            if new is S.ACQUIRING and proxy.connections == 1:
                proxy.stall()

        await lock.start()
        await rec.wait_event("error", timeout=10)
        assert "try_lock timed out" in str(rec.errors()[0])
        assert proxy.connections == 1
        await proxy.cut()
        proxy.resume()
        assert await lock.wait_for_leadership(10)
        assert proxy.connections >= 2  # a new session, never the interrupted one
        await lock.shutdown()


async def test_wait_mode_follower_is_granted_at_once(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    waiters: LockPids,
) -> None:
    await target.require(WaitingSession)
    a = target.lock(keys)
    b = target.lock(keys, retry_strategy=FixedInterval(30))  # one 30 s wait on the server
    assert b.follower_mode == "wait"
    rec_b = recorder(b)
    await rec_b.follow(a, 10)
    await eventually(lambda: _eq(waiters(*keys), [b.backend_pid]), 10, "b to queue")
    started = time.monotonic()
    await a.shutdown()
    assert await b.wait_for_leadership(2)
    assert time.monotonic() - started < 1.0
    assert await holders(*keys) == [b.backend_pid]


async def test_poll_mode_follower(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    waiters: LockPids,
) -> None:
    a = target.lock(keys, follower_mode="poll")
    b = target.lock(keys, follower_mode="poll")
    rec_b = recorder(b)
    await a.start()
    assert await a.wait_for_leadership(10)
    await b.start()
    await rec_b.wait_event("acquire_failed", count=3)
    assert not b.is_leader
    assert await waiters(*keys) == []  # polling never queues on the server
    await a.step_down()
    assert await b.wait_for_leadership(10)
    assert await holders(*keys) == [b.backend_pid]


async def test_terminated_leader_notices_within_milliseconds(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    terminate: Terminate,
) -> None:
    await target.require(WatchableSession)
    lock = target.lock(keys, health_interval_s=60.0, auto_reacquire=False)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    await asyncio.sleep(0.05)  # idle and watched
    started = time.monotonic()
    await terminate(lock.backend_pid)
    await rec.wait_event("lost", timeout=2)  # not 60 s: the session's watch told us
    assert time.monotonic() - started < 2
    await rec.wait_state(S.STOPPED)


@pytest.mark.parametrize("how", ["shutdown", "terminate"])
async def test_stopped_waiter_leaves_no_backend_behind(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    terminate: Terminate,
    waiters: LockPids,
    backend_alive: Callable[[int], Awaitable[bool]],
    how: str,
) -> None:
    await target.require(WaitingSession)
    a = target.lock(keys)
    await a.start()
    assert await a.wait_for_leadership(10)
    b = target.lock(keys, retry_strategy=FixedInterval(60))
    rec_b = recorder(b)
    await b.start()
    await rec_b.wait_event("acquire_failed")
    pid = b.backend_pid
    assert pid is not None
    await eventually(lambda: _eq(waiters(*keys), [pid]), 10, "b to queue")
    if how == "shutdown":
        await b.shutdown()
    else:  # the waiting backend dies: the follower reconnects, the old one is gone
        await terminate(pid)
        await rec_b.wait_event("error", timeout=5)
        await b.shutdown()
    # At once, not after the wait's lock_timeout: the wait was cancelled
    # on the server and the session closed.
    await eventually(lambda: _not(backend_alive(pid)), 0.3, f"the waiter to go ({how})")
    assert await waiters(*keys) == []
    assert a.is_leader


@pytest.mark.postgres_only("a role's search_path, on a real server")
async def test_a_search_path_hijack_reaches_nothing_the_lock_runs(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    admin: Admin,
    hijacking_role: tuple[str, str],
) -> None:
    """A role whose search_path puts another schema's ``pg_backend_pid()`` before
    ``pg_catalog`` (a database's or role's settings can): the lock's statements never
    call it (every name is qualified, and the session's own search_path is safe). The
    lock leads on its real backend; the impostor never ran."""
    role, calls = hijacking_role
    lock = target.lock(keys, dsn=target.dsn(user=role))
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    await asyncio.sleep(0.3)  # probes
    assert await holders(*keys) == [lock.backend_pid]
    await lock.shutdown()
    assert rec.names() == ["acquired", "released", "stopped"]
    cur = await admin.execute(f"SELECT is_called FROM {calls}".encode())
    assert await cur.fetchone() == (False,), "the impostor pg_backend_pid() ran"


@pytest.mark.postgres_only("raw driver connections, and pg_stat_activity")
async def test_connect_fn_may_return_a_raw_driver_connection(
    target: Target,
    keys: tuple[int, int],
    admin: Admin,
    holders: LockPids,
) -> None:
    target.require_raw_connections()

    async def connect() -> object:
        return await target.raw_connect()

    lock = LeaderLock(None, *keys, **lock_args(target.fast, connect_fn=connect))
    target.locks.append(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    assert await holders(*keys) == [lock.backend_pid]
    seen = set()
    for _ in range(30):  # across a few probes: autocommit, never idle in a transaction
        (state,) = await one_row(
            admin, "SELECT state FROM pg_stat_activity WHERE pid = %s", (lock.backend_pid,)
        )
        seen.add(state)
        await asyncio.sleep(0.01)  # kept: the pace of the sampling
    assert seen <= {"idle", "active"}, seen
    await lock.shutdown()
    assert await holders(*keys) == []


@pytest.mark.postgres_only("application_name lives in pg_stat_activity")
async def test_application_name_identifies_the_holder(
    target: Target, keys: tuple[int, int], admin: Admin
) -> None:
    lock = LeaderLock.from_name(
        f"contract-{target.id}-{keys[0]}",
        **lock_args(
            target.fast,
            dsn=target.dsn(),
            options=LockOptions(session=Session(backend=target.flavour.backend)),
        ),
    )
    target.locks.append(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    (name,) = await one_row(
        admin, "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (lock.backend_pid,)
    )
    assert name == lock.application_name
    assert name.startswith(f"pgleaderlock:contract-{target.id}-{keys[0]}@")


@pytest.mark.postgres_only("authentication happens on the server")
async def test_wrong_credentials_clear_error(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if target.flavour.engine:
        dsn = target.dsn(user="no_such_user_xyz", password="s3cr3t")
    else:
        dsn = target.url(user="no_such_user_xyz", password="s3cr3t")
    lock = target.lock(keys, dsn=dsn)
    rec = recorder(lock)
    with caplog.at_level("DEBUG", logger="pgleaderlock"):
        await lock.start()
        await rec.wait_event("error", timeout=10)
        await lock.shutdown()
    err = rec.errors()[0]
    assert isinstance(err, ConnectionError)
    assert err.__cause__ is not None
    assert "no_such_user_xyz" in str(err)
    assert "s3cr3t" not in str(err)
    assert "s3cr3t" not in caplog.text


@pytest.mark.postgres_only("connects to a closed TCP port")
async def test_unreachable_host_reports_errors_and_never_hangs(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    lock = target.lock(keys, dsn=target.dsn(host="127.0.0.1", port=port, password="hunter2"))
    rec = recorder(lock)
    await lock.start()
    await rec.wait_event("error", count=2, timeout=10)
    errors = rec.errors()
    assert all(isinstance(e, ConnectionError) for e in errors)
    assert "connect" in str(errors[0])
    assert "hunter2" not in str(errors[0])
    assert lock.state in (S.FOLLOWER, S.ACQUIRING)
    async with asyncio.timeout(3):
        await lock.shutdown()


@pytest.mark.postgres_only("connects to a TCP server that never answers")
async def test_silent_server_is_bounded_by_connect_timeout(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    """A server that accepts TCP but never answers: connect times out, no hang."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lock = target.lock(keys, dsn=target.dsn(host="127.0.0.1", port=port), connect_timeout_s=0.5)
    rec = recorder(lock)
    try:
        await lock.start()
        started = time.monotonic()
        await rec.wait_event("error", timeout=10)
        assert time.monotonic() - started < 5
        assert re.search("timed out|timeout expired", str(rec.errors()[0]))
        async with asyncio.timeout(3):
            await lock.shutdown()
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
