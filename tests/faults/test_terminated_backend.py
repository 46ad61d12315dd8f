"""Faults: ``pg_terminate_backend`` of the leader, of a follower, and during RELEASING.

On the shared test server: only the backends of this test's own locks are terminated.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import FixedInterval, LockState
from pgleaderlock.testing.beliefs import (
    TERMINATE_OVERLAP_LIMIT_S,
    BeliefLog,
    Fault,
    describe_overlaps,
)
from support.fixture_types import Figures
from support.poll import eventually
from support.proxy import proxied
from support.server import Admin, backend_gone

if TYPE_CHECKING:
    from faults.conftest import Candidates

S = LockState
pytestmark = pytest.mark.timeout(60)


async def terminate_and_wait(admin: Admin, pid: int | None, timeout_s: float = 5.0) -> None:
    """pg_terminate_backend(pid), then wait until the backend is gone."""
    await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    await backend_gone(admin, pid, timeout_s)


async def test_terminated_leader_is_lost_and_a_follower_takes_over(
    candidates: Candidates,
    admin: Admin,
    beliefs: BeliefLog,
    figures: Figures,
) -> None:
    """Six rounds of terminating whoever leads among three candidates. Each time the old
    leader reports on_lost and leaves LEADER, one candidate leads, the server agrees;
    beliefs overlap only by the measured "terminate overlap" (< 50 ms)."""
    locks = {name: candidates.lock(name) for name in "abc"}
    recs = {name: candidates.recorder(lock) for name, lock in locks.items()}
    for lock in locks.values():
        await lock.start()
    takeovers: list[float] = []
    for _ in range(6):
        await eventually(lambda: any(lock.is_leader for lock in locks.values()), 10, "a leader")
        name, leader = next((n, lock) for n, lock in locks.items() if lock.is_leader)
        # Kept: let the others queue on the server (each wait is one 50 ms lock_timeout,
        # so at no one moment need all of them be queued).
        await asyncio.sleep(0.2)
        pid = leader.backend_pid
        assert await candidates.holders() == [pid]
        lost_before = recs[name].names().count("lost")
        fault = beliefs.fault("terminate", name)
        await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await recs[name].wait_event("lost", count=lost_before + 1, timeout=5)

        def leads_again(f: Fault = fault) -> bool:
            # somebody leads again (possibly the old leader, on a new session)
            return any(i.start > f.t for n in locks for i in beliefs.intervals_of(n))

        t_next = await eventually(leads_again, 10, "a new leadership")
        takeovers.append(t_next - fault.t)
        new_leaders = [lock for lock in locks.values() if lock.is_leader]
        assert len(new_leaders) == 1
        assert await candidates.holders() == [new_leaders[0].backend_pid]
        assert new_leaders[0].backend_pid != pid
    for rec in recs.values():  # on_lost only ever follows on_acquired
        names = [n for n in rec.names() if n in ("acquired", "lost", "released")]
        for before, after in itertools.pairwise(names):
            assert (before, after) != ("lost", "lost")
        assert "lost" not in names[:1]
    report = beliefs.report()
    report.assert_safe()
    figures("terminate overlaps", len(report.terminate_overlaps), "of 6 terminations")
    figures("max terminate overlap", report.max_terminate_overlap_s, "ms")
    figures("max time to next leader", max(takeovers), "ms")
    print("terminate overlaps:", describe_overlaps(report.terminate_overlaps))
    assert report.max_terminate_overlap_s < TERMINATE_OVERLAP_LIMIT_S


async def test_terminated_follower_reconnects_and_stays_follower(
    candidates: Candidates,
    admin: Admin,
    beliefs: BeliefLog,
) -> None:
    """A follower whose backend is terminated (idle, and queued in pg_advisory_lock)
    reports on_error, never on_lost, reconnects and goes on following; the leader is
    untouched; the follower still takes over when the leader leaves."""
    a, b, rec_a, rec_b = await candidates.leader_and_follower(
        follower={"retry_strategy": FixedInterval(1.0)}  # 1 s server waits
    )
    for round_ in (1, 2):
        # b is now queued on the server (a 1 s wait): terminate that backend.
        old_pid = b.backend_pid
        assert old_pid is not None
        await terminate_and_wait(admin, old_pid)
        await rec_b.wait_event("error", count=round_, timeout=5)

        def reconnected(old: int = old_pid) -> bool:
            return b.backend_pid not in (None, old)

        def failed_again(old: int = old_pid) -> bool:
            return rec_b.names()[-1] == "acquire_failed" and b.backend_pid != old

        await eventually(reconnected, 10, "reconnect")
        await rec_b.wait(failed_again, 10)
    assert "lost" not in rec_b.names()
    assert "acquired" not in rec_b.names()
    assert rec_a.names() == ["acquired"]
    assert a.is_leader
    assert await candidates.holders() == [a.backend_pid]
    await a.shutdown()
    await candidates.assert_leads(b)
    beliefs.report().assert_safe()


@pytest.mark.parametrize("how", ["step_down", "shutdown"])
async def test_terminated_just_before_unlock(
    candidates: Candidates,
    admin: Admin,
    beliefs: BeliefLog,
    how: str,
) -> None:
    """The backend dies after the lock entered RELEASING, before the unlock runs: the
    unlock fails (on_error, no on_released), the session is closed, the lock is free on
    the server and the follower takes over; step_down() and shutdown() return."""
    a, rec_a = candidates.recorded("a")
    b, rec_b = candidates.recorded("b")

    @a.on_state_change
    async def kill_own_backend(old: LockState, new: LockState) -> None:
        if new is S.RELEASING:
            await terminate_and_wait(admin, a.backend_pid)

    await rec_b.follow(a, 10, 10)  # queued: b goes first
    async with asyncio.timeout(10):
        if how == "step_down":
            await a.step_down()
        else:
            await a.shutdown()
    assert "released" not in rec_a.names()
    assert "error" in rec_a.names()
    if how == "shutdown":
        assert a.state is S.STOPPED
        assert rec_a.names()[-1] == "stopped"
    else:
        assert a.state in (S.FOLLOWER, S.ACQUIRING)
    await candidates.assert_leads(b)
    beliefs.report().assert_safe()


@pytest.mark.parametrize("how", ["step_down", "shutdown"])
async def test_terminated_while_unlock_in_flight(
    pg_dsn: str,
    candidates: Candidates,
    admin: Admin,
    beliefs: BeliefLog,
    how: str,
) -> None:
    """The unlock is on the wire (held in a stalled proxy) when the backend is
    terminated: the client gets the FATAL instead of the unlock's result."""
    async with proxied(pg_dsn) as (proxy, dsn):
        a, b, rec_a, _ = await candidates.leader_and_follower(
            dsn, leader={"command_timeout_s": 10.0, "health_interval_s": 30.0}
        )
        pid = a.backend_pid
        proxy.stall()
        task = asyncio.ensure_future(a.step_down() if how == "step_down" else a.shutdown())
        await rec_a.wait(lambda: a.state is S.RELEASING, 5)
        await asyncio.sleep(0.1)  # the unlock is written into the stalled proxy
        assert await candidates.holders() == [pid]
        await terminate_and_wait(admin, pid)
        assert await b.wait_for_leadership(5)  # the server freed the lock at once
        proxy.resume()
        async with asyncio.timeout(10):
            await task
        assert "released" not in rec_a.names()
        assert "error" in rec_a.names()
        if how == "shutdown":
            assert a.state is S.STOPPED
        assert await candidates.holders() == [b.backend_pid]
        await a.shutdown()
    beliefs.report().assert_safe()
