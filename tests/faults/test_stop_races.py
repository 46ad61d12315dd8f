"""Stops that race the lifecycle: an external shutdown_event set mid-acquire, and
step_down() racing shutdown() (docs/concepts.md, decision 5: shutdown wins, step_down()
returns once the task has ended)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import FixedInterval, LockState
from pgleaderlock.testing.beliefs import BeliefLog
from support.fixture_types import MakeRecorder
from support.poll import eventually
from support.proxy import proxied
from support.server import Admin, backend_gone, one_row

if TYPE_CHECKING:
    from faults.conftest import Candidates
    from fix_locks import PgLock

S = LockState
pytestmark = pytest.mark.timeout(60)


async def test_shutdown_event_while_waiting_on_the_server(
    admin: Admin, candidates: Candidates, beliefs: BeliefLog
) -> None:
    """A follower queued in pg_advisory_lock for 30 s stops at once when its
    shutdown_event is set; its server-side wait is cancelled, its backend is gone."""
    event = asyncio.Event()
    a, b, _, rec_b = await candidates.leader_and_follower(
        follower={"shutdown_event": event, "retry_strategy": FixedInterval(30.0)}
    )
    pid = b.backend_pid

    async def queued() -> bool:
        row = await one_row(
            admin,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND pid = %s",
            (pid,),
        )
        n: int = row[0]
        return n == 1

    await eventually(queued, 10, "the follower's wait on the server", poll_s=0.01)
    stopping = time.monotonic()
    event.set()
    await eventually(lambda: b.state is S.STOPPED, 5, "the follower stops")
    assert time.monotonic() - stopping < 2.0
    assert rec_b.names()[-1] == "stopped"
    assert "acquired" not in rec_b.names()
    await backend_gone(admin, pid, timeout_s=2.0)
    assert a.is_leader
    assert await candidates.holders() == [a.backend_pid]
    beliefs.report().assert_safe()


async def test_shutdown_event_while_connecting(
    keys: tuple[int, int],
    pg_lock: PgLock,
    beliefs: BeliefLog,
    recorder: MakeRecorder,
) -> None:
    """A connect to a server that accepts TCP but never answers (connect_timeout_s=30)
    is interrupted by the shutdown_event: STOPPED at once, no error reported."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    event = asyncio.Event()
    try:
        lock = pg_lock(
            dsn=f"postgresql://postgres@127.0.0.1:{port}/postgres",
            keys=keys,
            name="a",
            shutdown_event=event,
            connect_timeout_s=30.0,
        )
        rec = recorder(lock)
        await lock.start()
        await eventually(lambda: bool(accepted), 5, "the connect reaches the server")
        await asyncio.sleep(0.2)  # kept: a window to leave the connect, wrongly
        assert lock.state is S.FOLLOWER  # still connecting
        stopping = time.monotonic()
        event.set()
        await eventually(lambda: lock.state is S.STOPPED, 5, "the lock stops")
        assert time.monotonic() - stopping < 2.0
        assert rec.errors() == []
        assert rec.names() == ["stopped"]
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    beliefs.report().assert_safe()


async def test_shutdown_event_while_try_lock_is_on_the_wire(
    pg_dsn: str, candidates: Candidates, beliefs: BeliefLog
) -> None:
    """pg_try_advisory_lock sent into a proxy that stopped forwarding: the event stops
    the lock at once; the session is closed, since the lock may have been granted; once
    the proxy lets go, nothing is held."""
    event = asyncio.Event()
    async with proxied(pg_dsn) as (proxy, dsn):
        lock, rec = candidates.recorded(
            "a", dsn, shutdown_event=event, command_timeout_s=30.0, follower_mode="poll"
        )

        @lock.on_state_change
        def stall_first_attempt(old: LockState, new: LockState) -> None:
            if new is S.ACQUIRING and proxy.connections == 1:
                proxy.stall()

        await lock.start()
        await rec.wait_state(S.ACQUIRING, timeout=10)
        await asyncio.sleep(0.2)  # kept: a window to leave the stalled attempt, wrongly
        assert lock.state is S.ACQUIRING
        stopping = time.monotonic()
        event.set()
        await eventually(lambda: lock.state is S.STOPPED, 5, "the lock stops")
        assert time.monotonic() - stopping < 2.0
        assert "acquired" not in rec.names()
        await proxy.cut()
        proxy.resume()
        deadline = time.monotonic() + 5
        while await candidates.holders():
            assert time.monotonic() < deadline, "the interrupted session kept the lock"
            await asyncio.sleep(0.02)
    beliefs.report().assert_safe()


@pytest.mark.parametrize("delay", [None, 0.0, 0.002, 0.02], ids=["same-tick", "0", "2ms", "20ms"])
@pytest.mark.parametrize("first", ["step_down", "shutdown"])
async def test_step_down_racing_shutdown(
    candidates: Candidates, beliefs: BeliefLog, first: str, delay: float | None
) -> None:
    """Both calls return; the lock ends STOPPED after exactly one release (no
    re-acquisition in between); the follower takes over with no overlap. (When
    step_down() must return is checked by the next test: the "0" cases hit it.)"""
    a, b, rec_a, _ = await candidates.leader_and_follower(
        leader={"retry_strategy": FixedInterval(0.5)}
    )
    calls = {"step_down": a.step_down, "shutdown": a.shutdown}
    second = "shutdown" if first == "step_down" else "step_down"
    loop = asyncio.get_running_loop()
    one = loop.create_task(calls[first]())
    if delay is not None:
        await asyncio.sleep(delay)
    two = loop.create_task(calls[second]())
    async with asyncio.timeout(10):
        await asyncio.gather(one, two)
    assert a.state is S.STOPPED
    names = rec_a.names()
    assert names.count("acquired") == 1
    assert names.count("released") == 1
    assert names[-1] == "stopped"
    await candidates.assert_leads(b)
    beliefs.report().assert_safe()


async def test_step_down_during_shutdown_release_returns_after_the_task_ended(
    candidates: Candidates,
) -> None:
    """docs/concepts.md, decision 5: shutdown() racing step_down(): shutdown wins and step_down()
    returns when the task has ended. Here step_down() is called while shutdown()'s
    release is in progress (held in RELEASING by a callback, deterministically)."""
    a = candidates.lock("a")
    releasing = asyncio.Event()
    gate = asyncio.Event()

    @a.on_state_change
    async def hold_in_releasing(old: LockState, new: LockState) -> None:
        if new is S.RELEASING:
            releasing.set()
            await gate.wait()

    await a.start()
    assert await a.wait_for_leadership(10)
    shutting_down = asyncio.ensure_future(a.shutdown())
    await asyncio.wait_for(releasing.wait(), 5)
    stepping_down = asyncio.ensure_future(a.step_down())
    await asyncio.sleep(0.1)  # kept: a window to return early, wrongly
    returned_early = stepping_down.done()
    state_then, holders_then = a.state, await candidates.holders()
    gate.set()
    async with asyncio.timeout(10):
        await asyncio.gather(shutting_down, stepping_down)
    assert a.state is S.STOPPED
    assert await candidates.holders() == []
    assert not returned_early, (
        f"step_down() returned while the shutdown was still releasing "
        f"(state {state_then.value}, lock holders {holders_then})"
    )


async def test_step_down_timeout_racing_shutdown_with_the_unlock_stuck(
    pg_dsn: str, candidates: Candidates, beliefs: BeliefLog
) -> None:
    """The unlock is stuck in a stalled proxy: step_down(timeout_s=0.3) gives up and
    closes the session while shutdown() runs; both return within the timeouts and the
    lock is freed once the proxy lets go of the connection."""
    async with proxied(pg_dsn) as (proxy, dsn):
        a, rec_a = candidates.recorded("a", dsn, command_timeout_s=5.0, health_interval_s=30.0)
        b = candidates.lock("b")
        await a.start()
        assert await a.wait_for_leadership(10)
        await b.start()
        proxy.stall()
        started = time.monotonic()
        async with asyncio.timeout(10):
            await asyncio.gather(a.step_down(timeout_s=0.3), a.shutdown(timeout_s=8))
        assert time.monotonic() - started < 2.0  # the step_down timeout, not the 5 s unlock
        assert a.state is S.STOPPED
        assert "released" not in rec_a.names()
        assert rec_a.names()[-1] == "stopped"
        await proxy.cut()
        proxy.resume()
        await candidates.assert_leads(b)
    beliefs.report().assert_safe()
