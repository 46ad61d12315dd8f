"""LeaderLock's leadership on the in-memory FakeServer: acquiring, losing it and taking over
(health probes, grace, flap damping), handing it over (step-down) and following (the
follower modes), without a database. Start, shutdown and errors: test_lock_lifecycle.py."""

from __future__ import annotations

import asyncio

import pytest

from pgleaderlock import (
    ConfigurationError,
    ConnectionError,
    FixedInterval,
    LeaderLock,
    LockState,
    RetryContext,
    Session,
)
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorded, MakeRecorder
from support.locks import another_holds, leading
from support.poll import eventually

S = LockState
pytestmark = pytest.mark.timeout(30)


async def test_single_lock_becomes_leader(recorded: MakeRecorded, server: FakeServer) -> None:
    lock, rec = recorded()
    assert lock.state is S.STOPPED
    await lock.start()
    assert lock.state is not S.STOPPED
    assert await lock.wait_for_leadership(5)
    assert lock.is_leader
    assert lock.leader_since is not None
    assert server.holder(1, 2) is not None
    assert rec.states() == [S.FOLLOWER, S.ACQUIRING, S.LEADER]
    assert rec.names() == ["acquired"]
    await lock.shutdown()
    assert lock.state is S.STOPPED
    assert server.holder(1, 2) is None
    assert rec.names() == ["acquired", "released", "stopped"]
    assert rec.states()[-2:] == [S.RELEASING, S.STOPPED]


async def test_two_locks_one_leader(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    a, b = make_lock(), make_lock()
    rec_b = recorder(b)
    await a.start()
    assert await a.wait_for_leadership(5)
    await b.start()
    await rec_b.wait_event("acquire_failed", count=3)
    assert a.is_leader
    assert not b.is_leader
    assert "acquired" not in rec_b.names()
    assert server.hold_count(1, 2) == 1


async def test_health_probes_never_reacquire(make_lock: MakeLock, server: FakeServer) -> None:
    """The lock is held once, however long the leadership lasts (docs/guarantees.md:
    never re-acquire while leader)."""
    lock = make_lock()
    await lock.start()
    assert await lock.wait_for_leadership(5)
    before = server.calls["probe"]
    await eventually(lambda: server.calls["probe"] >= before + 10, 5, "10 more probes")
    assert server.hold_count(1, 2) == 1
    assert server.calls["try_lock"] == 1


async def test_terminated_leader_loses_and_follower_takes_over(
    make_lock: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    a, b = make_lock(), make_lock()
    rec_a, rec_b = recorder(a), recorder(b)
    await rec_b.follow(a)
    server.terminate()
    await rec_a.wait_event("lost")
    assert not a.is_leader
    await rec_b.wait_event("acquired")
    assert b.is_leader
    assert rec_a.names()[:2] == ["acquired", "lost"]
    assert S.RECONNECTING not in rec_a.states()


async def test_probe_checks_this_session_holds_the_lock(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    """A session that answers but no longer holds the lock is not a leader."""
    lock, rec = await leading(recorded(auto_reacquire=False))
    session = server.holder(1, 2)
    assert session is not None
    server._free(session)  # the lock vanished; the session itself is fine
    await rec.wait_event("lost")
    assert lock.state is S.STOPPED
    assert not session.killed


async def test_flap_damping_recovers_silently(recorded: MakeRecorded, server: FakeServer) -> None:
    _, rec = await leading(recorded(reconnect_grace_s=5.0))
    first = server.holder(1, 2)
    server.terminate()
    await rec.wait(lambda: S.RECONNECTING in rec.states())
    await rec.wait(lambda: rec.states()[-1] is S.LEADER)
    assert server.holder(1, 2) is not first
    assert rec.names() == ["acquired"]  # no on_lost, no second on_acquired
    assert rec.states()[-2:] == [S.RECONNECTING, S.LEADER]


async def test_is_leader_false_during_reconnecting(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    lock, rec = recorded(reconnect_grace_s=5.0)
    seen: list[bool] = []
    lock.on_state_change(
        lambda old, new: seen.append(lock.is_leader) if new is S.RECONNECTING else None
    )
    await lock.start()
    assert await lock.wait_for_leadership(5)
    server.refuse_connections = ConnectionError("server down")
    server.terminate()
    await rec.wait_state(S.RECONNECTING)
    assert seen == [False]
    assert not lock.is_leader
    server.refuse_connections = None
    await rec.wait_state(S.LEADER)


async def test_grace_reacquire_failed_when_someone_else_got_it(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    a, rec = await leading(recorded(reconnect_grace_s=5.0))
    server.refuse_connections = ConnectionError("down")
    server.terminate()
    await rec.wait_state(S.RECONNECTING)
    server.refuse_connections = None
    intruder = await another_holds(server)
    await rec.wait_event("lost")
    assert a.state in (S.FOLLOWER, S.ACQUIRING)
    await intruder.close()
    await rec.wait_event("acquired", count=2)


async def test_grace_expires(recorded: MakeRecorded, server: FakeServer) -> None:
    _, rec = await leading(recorded(reconnect_grace_s=0.2))
    server.refuse_connections = ConnectionError("down")
    server.terminate()
    await rec.wait_event("lost")
    states = rec.states()
    assert states[states.index(S.RECONNECTING) + 1] is S.FOLLOWER
    server.refuse_connections = None
    await rec.wait_event("acquired", count=2)


async def test_no_auto_reacquire_stops_after_loss(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    _, rec = await leading(recorded(auto_reacquire=False))
    server.terminate()
    await rec.wait_state(S.STOPPED)
    assert rec.names() == ["acquired", "lost", "stopped"]


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


async def test_step_down_without_auto_reacquire_stops(recorded: MakeRecorded) -> None:
    lock, rec = await leading(recorded(auto_reacquire=False))
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
    recorded: MakeRecorded, server: FakeServer
) -> None:
    lock, rec = await leading(recorded(command_timeout_s=30))
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
    recorded: MakeRecorded, server: FakeServer
) -> None:
    lock, rec = await leading(recorded())
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


async def test_mutual_exclusion_among_many(make_lock: MakeLock, server: FakeServer) -> None:
    locks = [make_lock() for _ in range(5)]
    leaders_seen: list[int] = []
    for i, lock in enumerate(locks):
        lock.on_acquired(lambda i=i: leaders_seen.append(i))
    await asyncio.gather(*(lock.start() for lock in locks))
    for _ in range(4):
        await eventually(lambda: any(lock.is_leader for lock in locks), 5, "a leader")
        assert sum(lock.is_leader for lock in locks) <= 1
        leader = next(lock for lock in locks if lock.is_leader)
        await leader.step_down()
    assert len(leaders_seen) >= 4


async def test_repr_shows_state(make_lock: MakeLock) -> None:
    lock = make_lock()
    assert repr(lock) == "<LeaderLock keys=(1, 2) state=stopped>"
    named = LeaderLock.from_name("jobs", dsn="postgresql://x@h/db")
    assert repr(named).startswith("<LeaderLock name='jobs' keys=(")


async def test_waiting_follower_takes_over_at_once(
    recorded: MakeRecorded, make_lock: MakeLock, server: FakeServer
) -> None:
    a = make_lock()
    b, rec_b = recorded(retry_strategy=FixedInterval(30))
    await rec_b.follow(a)
    await eventually(lambda: server.calls["wait_lock"] > 0, 5, "b waiting on the server")
    await a.shutdown()
    assert await b.wait_for_leadership(2)  # granted when freed, not 30 s later


async def test_polling_follower_waits_for_its_next_attempt(
    recorded: MakeRecorded, make_lock: MakeLock, server: FakeServer
) -> None:
    a = make_lock()
    b, rec_b = recorded(retry_strategy=FixedInterval(30), follower_mode="poll")
    await rec_b.follow(a)
    await a.shutdown()
    assert await b.wait_for_leadership(0.3) is False
    assert server.calls["wait_lock"] == 0


async def test_each_wait_without_the_lock_is_a_failed_attempt(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    holder = await another_holds(server)
    contexts: list[RetryContext] = []

    class Recording:
        def next_delay_s(self, ctx: RetryContext) -> float:
            contexts.append(ctx)
            return 0.02

    lock, rec = recorded(retry_strategy=Recording())
    await lock.start()
    await rec.wait_event("acquire_failed", count=4)
    assert server.calls["try_lock"] == 2  # the holder, then our first attempt: no wait
    assert server.calls["wait_lock"] >= 3
    assert [c.attempt for c in contexts[:4]] == [1, 2, 3, 4]
    assert all(c.last_error is None for c in contexts)
    await holder.close()
    assert await lock.wait_for_leadership(2)


async def test_connection_failures_sleep_instead_of_waiting(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    server.refuse_connections = ConnectionError("down")
    lock, rec = recorded(retry_strategy=FixedInterval(0.05))
    await lock.start()
    await rec.wait_event("error", count=3)
    assert server.calls["wait_lock"] == 0
    assert server.calls["try_lock"] == 0


async def test_shutdown_while_waiting_leaves_no_waiter(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    holder = await another_holds(server)
    lock, rec = recorded(retry_strategy=FixedInterval(60))
    await lock.start()
    await rec.wait_event("acquire_failed")
    await eventually(lambda: server._waiters.get((1, 2)), 5, "the lock queued on the server")
    async with asyncio.timeout(2):
        await lock.shutdown()
    assert server._waiters[(1, 2)] == []
    assert lock.state is S.STOPPED
    await holder.close()


async def test_idle_session_watch_detects_termination_at_once(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    _, rec = await leading(recorded(health_interval_s=60))
    probes = server.calls["probe"]
    server.terminate()
    await rec.wait_event("lost", timeout=2)
    assert server.calls["probe"] == probes + 1  # one probe, triggered by the alarm


def test_follower_mode_is_validated() -> None:
    with pytest.raises(ConfigurationError, match="follower_mode"):
        Session(follower_mode="block")  # type: ignore[arg-type]
