"""LeaderLock's start and shutdown on the in-memory FakeServer: idempotent shutdown,
restart, ``async with``, what a shutdown interrupts, an external shutdown event, and
``wait_for_leadership``."""

from __future__ import annotations

import asyncio

import pytest

from pgleaderlock import (
    FixedInterval,
    LeaderLock,
    LockState,
    ShutdownError,
)
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorder
from support.poll import eventually

S = LockState
pytestmark = pytest.mark.timeout(30)


async def test_shutdown_is_idempotent_and_releases(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    lock = make_lock()
    rec = recorder(lock)
    await lock.shutdown()  # never started: nothing to do
    await lock.start()
    await lock.start()  # idempotent
    assert await lock.wait_for_leadership(5)
    assert len(server.sessions) == 1
    await lock.shutdown()
    await lock.shutdown()
    assert rec.names().count("stopped") == 1
    assert server.calls["unlock"] == 1
    assert server.open_sessions == []


async def test_restart_after_shutdown(make_lock: MakeLock, recorder: MakeRecorder) -> None:
    lock = make_lock()
    rec = recorder(lock)
    for _ in range(2):
        await lock.start()
        assert await lock.wait_for_leadership(5)
        await lock.shutdown()
    assert rec.names() == ["acquired", "released", "stopped"] * 2


async def test_context_manager(make_lock: MakeLock, server: FakeServer) -> None:
    lock = make_lock()
    async with lock as entered:
        assert entered is lock
        assert await lock.wait_for_leadership(5)
    assert lock.state is S.STOPPED
    assert server.holder(1, 2) is None


async def test_context_manager_shuts_down_on_exception(
    make_lock: MakeLock, server: FakeServer
) -> None:
    lock = make_lock()
    with pytest.raises(RuntimeError, match="user code failed"):
        async with lock:
            assert await lock.wait_for_leadership(5)
            raise RuntimeError("user code failed")
    assert lock.state is S.STOPPED
    assert server.holder(1, 2) is None


async def test_shutdown_interrupts_a_hanging_try_lock(
    make_lock: MakeLock, server: FakeServer
) -> None:
    server.hang("try_lock", grant_first=True)
    lock = make_lock(command_timeout_s=60)
    await lock.start()
    await eventually(lambda: server.calls["try_lock"] > 0, 5, "a try_lock")
    async with asyncio.timeout(2):
        await lock.shutdown()
    assert lock.state is S.STOPPED
    assert server.holder(1, 2) is None
    assert server.open_sessions == []


async def test_shutdown_interrupts_a_hanging_connect(
    make_lock: MakeLock, server: FakeServer
) -> None:
    server.hang("connect")
    lock = make_lock(connect_timeout_s=60)
    await lock.start()
    await eventually(lambda: server.calls["connect"] > 0, 5, "a connect")
    async with asyncio.timeout(2):
        await lock.shutdown()
    assert lock.state is S.STOPPED


async def test_shutdown_timeout_raises_cleans_up_and_reports_the_stop(
    make_lock: MakeLock,
    server: FakeServer,
    recorder: MakeRecorder,
) -> None:
    lock = make_lock()
    rec = recorder(lock)
    gate = asyncio.Event()

    @lock.on_released
    async def stuck() -> None:
        await gate.wait()

    await lock.start()
    assert await lock.wait_for_leadership(5)
    with pytest.raises(ShutdownError):
        await lock.shutdown(timeout_s=0.1)
    assert lock.state is S.STOPPED
    assert server.open_sessions == []
    assert rec.names()[-1] == "stopped"  # a forced stop is still reported
    assert rec.states()[-1] is S.STOPPED


async def test_shutdown_from_a_callback_does_not_deadlock(
    make_lock: MakeLock, recorder: MakeRecorder
) -> None:
    lock = make_lock()
    rec = recorder(lock)

    @lock.on_acquired
    async def stop_now() -> None:
        await lock.shutdown()

    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert rec.names() == ["acquired", "released", "stopped"]


async def test_external_shutdown_event(make_lock: MakeLock, recorder: MakeRecorder) -> None:
    event = asyncio.Event()
    lock = make_lock(shutdown_event=event)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(5)
    event.set()
    await rec.wait_state(S.STOPPED)
    assert rec.names() == ["acquired", "released", "stopped"]


async def test_external_shutdown_event_while_following(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    event = asyncio.Event()
    lock = make_lock(shutdown_event=event, retry_strategy=FixedInterval(30))
    rec = recorder(lock)
    await lock.start()
    await rec.wait_event("acquire_failed")
    event.set()
    await rec.wait_state(S.STOPPED, timeout=2)
    await holder.close()


async def test_wait_for_leadership(make_lock: MakeLock, server: FakeServer) -> None:
    lock = make_lock()
    assert await lock.wait_for_leadership(0.05) is False  # not started
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    await lock.start()
    assert await lock.wait_for_leadership(0.1) is False
    await holder.close()
    assert await lock.wait_for_leadership(5) is True


async def test_wait_for_leadership_returns_false_when_stopped(
    make_lock: MakeLock, server: FakeServer
) -> None:
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    lock = make_lock()
    await lock.start()
    waiter = asyncio.create_task(lock.wait_for_leadership())
    # the holder's try_lock was the first; the lock's own attempt fails
    await eventually(lambda: server.calls["try_lock"] >= 2, 5, "the lock's attempt")
    await lock.shutdown()
    assert await asyncio.wait_for(waiter, 2) is False
    await holder.close()


def test_restart_on_another_event_loop() -> None:
    """A lock outlives its event loop: e.g. an app whose lifespan runs twice."""
    server = FakeServer()
    lock = LeaderLock(None, 1, 2, connect_fn=server.connect, retry_strategy=FixedInterval(0.01))
    assert lock.retry_strategy is not None

    async def cycle() -> bool:
        await lock.start()
        leader = await lock.wait_for_leadership(5)
        await lock.shutdown()
        return leader

    assert asyncio.run(cycle())
    assert asyncio.run(cycle())
    assert server.open_sessions == []
