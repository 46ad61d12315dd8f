"""Faults of the server itself, each on a private throwaway cluster: restarts (fast,
immediate, SIGKILL of the postmaster) and a server that is down when the lock starts."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Literal

import psycopg
import pytest

from pgleaderlock import ConnectionError, FixedInterval, LockState
from pgleaderlock.testing import ThrowawayPostgres
from pgleaderlock.testing.beliefs import BeliefLog
from support.fixture_types import Figures
from support.server import lock_holders

if TYPE_CHECKING:
    from faults.conftest import Candidates

S = LockState
pytestmark = [pytest.mark.timeout(60), pytest.mark.throwaway]


def bounce(pg: ThrowawayPostgres, mode: Literal["fast", "immediate", "kill"]) -> None:
    """Restart the throwaway server (blocking: run it in a thread)."""
    if mode == "kill":
        pg.kill()  # SIGKILL the postmaster, then its orphaned backends
        pg.start_again()
    else:
        pg.restart(mode)


@pytest.mark.parametrize("mode", ["fast", "immediate", "kill"])
async def test_server_restart(
    throwaway_pg: ThrowawayPostgres,
    throwaway_candidates: Candidates,
    beliefs: BeliefLog,
    figures: Figures,
    mode: Literal["fast", "immediate", "kill"],
) -> None:
    """The leader reports on_lost at once (the socket tells), the follower reports
    on_error; once the server is back exactly one of them leads, and the server agrees.

    Going down, the server ends the leader's backend like ``pg_terminate_backend``
    does, and may grant the lock to the queued follower's backend before that one is
    ended too (seen with a SIGKILLed postmaster: the backends exit one by one as they
    notice). So the follower may believe it leads for a moment, as early as a few ms
    before the old leader has noticed: a terminate overlap, bounded like one."""
    pg = throwaway_pg
    a, b, rec_a, rec_b = await throwaway_candidates.leader_and_follower()
    beliefs.fault("terminate", "a")  # the server going down ends a's backend
    started = time.monotonic()
    restart = asyncio.ensure_future(asyncio.to_thread(bounce, pg, mode))
    try:
        await rec_a.wait_event("lost", timeout=10)
        lost_after = time.monotonic() - started
    finally:
        await restart
    # b's backend was ended too (on_error), unless the dying server granted it the lock
    # for a moment first (then on_lost).
    await rec_b.wait(lambda: {"error", "lost"} & set(rec_b.names()), 10)
    async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as admin:
        deadline = time.monotonic() + 15
        while True:  # one leader, and the server agrees
            leaders = [lock for lock in (a, b) if lock.is_leader]
            held = await lock_holders(admin, *throwaway_candidates.keys)
            if len(leaders) == 1 and held == [leaders[0].backend_pid]:
                break
            assert time.monotonic() < deadline, f"leaders {leaders}, holders {held}"
            await asyncio.sleep(0.02)
    report = beliefs.report()
    assert report.longest_gap is not None
    figures(f"on_lost after {mode} restart began", lost_after, "ms")
    figures("leaderless gap", report.longest_gap.size_s, "ms")
    figures("terminate overlap", report.max_terminate_overlap_s, "ms")
    assert rec_a.names()[:2] == ["acquired", "lost"]
    assert all(isinstance(e, ConnectionError) for e in rec_b.errors())
    beliefs.report().assert_safe()


async def test_fast_restart_with_flap_damping_recovers_silently(
    throwaway_pg: ThrowawayPostgres,
    throwaway_candidates: Candidates,
    beliefs: BeliefLog,
) -> None:
    """With reconnect_grace_s longer than the restart, the leader goes RECONNECTING,
    re-acquires on a new session and never reports on_lost."""
    pg = throwaway_pg
    a, rec = throwaway_candidates.recorded("a", reconnect_grace_s=10.0)
    await a.start()
    assert await a.wait_for_leadership(10)
    old_pid = a.backend_pid
    await asyncio.to_thread(pg.restart, "fast")
    await rec.wait(lambda: S.RECONNECTING in rec.states() and a.is_leader, 15)
    assert rec.names() == ["acquired"]
    assert a.backend_pid != old_pid
    assert await throwaway_candidates.holders() == [a.backend_pid]
    beliefs.report().assert_safe()


async def test_server_down_at_start(
    throwaway_pg: ThrowawayPostgres,
    throwaway_candidates: Candidates,
    beliefs: BeliefLog,
    figures: Figures,
) -> None:
    """Connection errors go to on_error and are retried; the lock leads as soon as the
    server is up."""
    pg = throwaway_pg
    await asyncio.to_thread(pg.stop)
    lock, rec = throwaway_candidates.recorded("a", retry_strategy=FixedInterval(0.1))
    await lock.start()
    await rec.wait_event("error", count=3, timeout=10)
    assert all(isinstance(e, ConnectionError) for e in rec.errors())
    assert not lock.is_leader
    assert lock.state in (S.FOLLOWER, S.ACQUIRING)
    starting = time.monotonic()
    await asyncio.to_thread(pg.start_again)
    assert await lock.wait_for_leadership(10)
    figures("leader after start_again() began", time.monotonic() - starting, "ms")
    assert "lost" not in rec.names()
    assert await throwaway_candidates.holders() == [lock.backend_pid]
    beliefs.report().assert_safe()
