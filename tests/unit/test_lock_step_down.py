"""LeaderLock.step_down on the in-memory FakeServer: handing over, its timeout, a failed
unlock, and step-down racing start and shutdown."""

from __future__ import annotations

import asyncio

import pytest

from pgleaderlock import (
    ConnectionError,
    FixedInterval,
    LeaderLock,
    LockState,
)
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorder

S = LockState
pytestmark = pytest.mark.timeout(30)


async def test_step_down_hands_over(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    a, b = make_lock(retry_strategy=FixedInterval(0.3)), make_lock()
    rec_a, rec_b = recorder(a), recorder(b)
    await rec_b.follow(a)
    await a.step_down()
    assert a.state in (S.FOLLOWER, S.ACQUIRING)
    assert rec_a.names() == ["acquired", "released"]
    await rec_b.wait_event("acquired")
    assert b.is_leader
    await b.shutdown()
    await rec_a.wait_event("acquired", count=2)


async def test_step_down_without_auto_reacquire_stops(
    make_lock: MakeLock, recorder: MakeRecorder
) -> None:
    lock = make_lock(auto_reacquire=False)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(5)
    await lock.step_down()
    assert lock.state is S.STOPPED
    assert rec.names() == ["acquired", "released", "stopped"]


async def test_step_down_when_not_leader_returns_at_once(
    make_lock: MakeLock, server: FakeServer
) -> None:
    a, b = make_lock(), make_lock()
    await a.start()
    assert await a.wait_for_leadership(5)
    await b.start()
    async with asyncio.timeout(1):
        await b.step_down()
    assert a.is_leader
    await LeaderLock(None, 1, 2, connect_fn=server.connect).step_down()  # never started


async def test_step_down_timeout_cycles_the_connection(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    lock = make_lock(command_timeout_s=30)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(5)
    session = server.holder(1, 2)
    assert session is not None
    server.hang("unlock")
    async with asyncio.timeout(5):
        await lock.step_down(timeout_s=0.1)
    assert session.closed
    assert server.holder(1, 2) is not session
    assert any(isinstance(e, ConnectionError) for e in rec.errors())
    assert lock.state in (S.FOLLOWER, S.ACQUIRING, S.LEADER)


async def test_failed_unlock_in_step_down_continues_as_follower(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    lock = make_lock()
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(5)
    server.fail_calls["unlock"] = ConnectionError("boom")
    await lock.step_down()
    assert rec.names()[:2] == ["acquired", "error"]
    assert lock.state is not S.STOPPED
    await rec.wait_event("acquired", count=2)


async def test_concurrent_start_shutdown_step_down(make_lock: MakeLock, server: FakeServer) -> None:
    locks = [make_lock() for _ in range(3)]
    for _ in range(5):
        await asyncio.gather(*(lock.start() for lock in locks), *(lock.start() for lock in locks))
        await asyncio.sleep(0.02)  # kept: the race under test, whatever state the locks reached
        await asyncio.gather(
            *(lock.step_down(timeout_s=1) for lock in locks),
            *(lock.shutdown() for lock in locks),
            *(lock.step_down() for lock in locks),
        )
        assert all(lock.state is S.STOPPED for lock in locks)
        assert server.holder(1, 2) is None
        assert server.open_sessions == []


async def test_step_down_racing_shutdown(make_lock: MakeLock, server: FakeServer) -> None:
    lock = make_lock()
    await lock.start()
    assert await lock.wait_for_leadership(5)
    await asyncio.gather(lock.step_down(), lock.shutdown())
    assert lock.state is S.STOPPED
    assert server.open_sessions == []
