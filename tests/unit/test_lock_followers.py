"""LeaderLock's follower modes on the in-memory FakeServer: a waiting follower takes over
at once, a polling one at its next attempt."""

from __future__ import annotations

import asyncio

import pytest

from pgleaderlock import (
    ConfigurationError,
    ConnectionError,
    FixedInterval,
    LockState,
    RetryContext,
    Session,
)
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorder
from support.poll import eventually

S = LockState
pytestmark = pytest.mark.timeout(30)


async def test_waiting_follower_takes_over_at_once(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    a = make_lock()
    b = make_lock(retry_strategy=FixedInterval(30))  # waits on the server for 30 s
    rec_b = recorder(b)
    await rec_b.follow(a)
    await eventually(lambda: server.calls["wait_lock"] > 0, 5, "b waiting on the server")
    await a.shutdown()
    assert await b.wait_for_leadership(2)  # granted when freed, not 30 s later


async def test_polling_follower_waits_for_its_next_attempt(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    a = make_lock()
    b = make_lock(retry_strategy=FixedInterval(30), follower_mode="poll")
    rec_b = recorder(b)
    await rec_b.follow(a)
    await a.shutdown()
    assert await b.wait_for_leadership(0.3) is False
    assert server.calls["wait_lock"] == 0


async def test_each_wait_without_the_lock_is_a_failed_attempt(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    contexts: list[RetryContext] = []

    class Recording:
        def next_delay_s(self, ctx: RetryContext) -> float:
            contexts.append(ctx)
            return 0.02

    lock = make_lock(retry_strategy=Recording())
    rec = recorder(lock)
    await lock.start()
    await rec.wait_event("acquire_failed", count=4)
    assert server.calls["try_lock"] == 2  # the holder, then our first attempt: no wait
    assert server.calls["wait_lock"] >= 3
    assert [c.attempt for c in contexts[:4]] == [1, 2, 3, 4]
    assert all(c.last_error is None for c in contexts)
    await holder.close()
    assert await lock.wait_for_leadership(2)


async def test_connection_failures_sleep_instead_of_waiting(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    server.refuse_connections = ConnectionError("down")
    lock = make_lock(retry_strategy=FixedInterval(0.05))
    rec = recorder(lock)
    await lock.start()
    await rec.wait_event("error", count=3)
    assert server.calls["wait_lock"] == 0
    assert server.calls["try_lock"] == 0


async def test_shutdown_while_waiting_leaves_no_waiter(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    lock = make_lock(retry_strategy=FixedInterval(60))
    rec = recorder(lock)
    await lock.start()
    await rec.wait_event("acquire_failed")
    await eventually(lambda: server._waiters.get((1, 2)), 5, "the lock queued on the server")
    async with asyncio.timeout(2):
        await lock.shutdown()
    assert server._waiters[(1, 2)] == []
    assert lock.state is S.STOPPED
    await holder.close()


async def test_idle_session_watch_detects_termination_at_once(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    lock = make_lock(health_interval_s=60)  # the periodic probe would come far too late
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(5)
    probes = server.calls["probe"]
    server.terminate()
    await rec.wait_event("lost", timeout=2)
    assert server.calls["probe"] == probes + 1  # one probe, triggered by the alarm


def test_follower_mode_is_validated() -> None:
    with pytest.raises(ConfigurationError, match="follower_mode"):
        Session(follower_mode="block")  # type: ignore[arg-type]
