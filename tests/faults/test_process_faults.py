"""Faults: a candidate's *process* is SIGKILLed (a real child process running a LeaderLock)."""

from __future__ import annotations

import signal
import statistics
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import FixedInterval
from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from support.fixture_types import Figures

if TYPE_CHECKING:
    from faults.conftest import Candidates

pytestmark = pytest.mark.timeout(60)

CHILD = CandidateOptions(health_interval_s=0.5, health_timeout_s=0.5, retry_s=0.05)


async def test_sigkilled_leader_process_is_replaced_at_once(
    pg_dsn: str,
    candidates: Candidates,
    beliefs: BeliefLog,
    figures: Figures,
) -> None:
    """Three rounds: a child process leads, the test process follows (queued on the
    server), the child is SIGKILLed: its kernel closes the socket, the server frees the
    lock and the follower leads within milliseconds. The killed child's belief ends at
    the kill, strictly before the follower's begins."""
    parent, rec = candidates.recorded("parent", retry_strategy=FixedInterval(0.5))
    takeovers = []
    for round_ in range(3):
        child = CandidateProcess(
            f"child{round_}", pg_dsn, *candidates.keys, options=CHILD, beliefs=beliefs
        )
        try:
            await child.start()
            if round_ == 0:
                await child.wait_event("acquired", timeout_s=10)
                await parent.start()
            else:  # the parent leads: hand over to the new child
                await child.wait_event("acquire_failed", timeout_s=10)
                await parent.step_down()
                await child.wait_event("acquired", timeout_s=10)
            await rec.wait(lambda: rec.names()[-1:] == ["acquire_failed"], 10)  # queued
            assert await candidates.holders() == [child.backend_pid]
            killed_at = await child.kill()
            assert child.returncode == -signal.SIGKILL
            assert await parent.wait_for_leadership(5)
            started = [i.start for i in beliefs.intervals_of("parent") if i.start > killed_at]
            takeovers.append(started[0] - killed_at)
            assert await candidates.holders() == [parent.backend_pid]
        finally:
            await child.kill()
    figures("takeover after SIGKILL (median of 3)", statistics.median(takeovers), "ms")
    figures("takeover after SIGKILL (max of 3)", max(takeovers), "ms")
    report = beliefs.report()
    assert [i.end_reason for i in report.intervals if i.candidate.startswith("child")] == [
        "killed"
    ] * 3
    report.assert_safe()


async def test_sigkilled_waiting_follower_is_never_granted(
    pg_dsn: str,
    candidates: Candidates,
    beliefs: BeliefLog,
) -> None:
    """A follower process queued in pg_advisory_lock is SIGKILLed, and the leader steps
    down right after: the dead follower's backend must not keep the lock (granted, it
    finds its client gone when it answers, and exits), so a live candidate leads."""
    leader = candidates.lock("leader", retry_strategy=FixedInterval(10.0))
    other = candidates.lock("other", retry_strategy=FixedInterval(0.2))
    opts = CandidateOptions(health_interval_s=0.5, health_timeout_s=0.5, retry_s=30.0)
    child = CandidateProcess("child", pg_dsn, *candidates.keys, options=opts, beliefs=beliefs)
    try:
        await leader.start()
        assert await leader.wait_for_leadership(10)
        await child.start()
        await child.wait_event("acquire_failed", timeout_s=10)  # now queued for 30 s
        dead_pid = child.backend_pid
        await child.kill()
        await leader.step_down()  # the dead follower's backend is first in the queue
        await other.start()
        assert await other.wait_for_leadership(5), f"holders: {await candidates.holders()}"
        assert dead_pid not in await candidates.holders()
    finally:
        await child.kill()
    assert not beliefs.intervals_of("child")
    beliefs.report().assert_safe()
