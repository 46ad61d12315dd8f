"""A slow server is not a lost session: a probe that is late while the server has
acknowledged it suspends leadership (not LEADER) and resumes when the answer comes, with
no ``on_lost``; a silent network still loses the lock at the demotion bound (the
partition test in test_network_faults.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import LeaderLock, LockState
from pgleaderlock.testing.beliefs import BeliefLog
from support.fixture_types import Figures
from support.poll import eventually

if TYPE_CHECKING:
    from faults.conftest import Candidates

S = LockState
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def lead_and_probe(lock: LeaderLock, probes: int) -> int:
    """Start ``lock``; once it leads and has answered ``probes`` health probes, return
    its backend's pid."""
    await lock.start()
    assert await lock.wait_for_leadership(5)
    await eventually(lambda: lock.statistics().probes >= probes, 5, f"{probes} probes")
    pid = lock.backend_pid
    assert pid is not None
    try:
        os.kill(pid, 0)  # may this process signal the server's backends?
    except PermissionError:
        pytest.skip(
            "freezes a server backend with SIGSTOP: needs root or the server's own OS user"
            " (run the suite as root, or against a server this user started)"
        )
    return pid


@pytest.mark.parametrize("probes_before", [0, 2], ids=["pg_locks-probe", "periodic-probe"])
async def test_a_frozen_backend_suspends_leadership_without_losing_it(
    probes_before: int,
    candidates: Candidates,
    beliefs: BeliefLog,
    figures: Figures,
) -> None:
    """SIGSTOP of the lock's own server backend: the kernel still acknowledges the probe,
    the backend does not answer. The lock leaves LEADER at the demotion bound, keeps its
    session, and is LEADER again, silently, once the backend answers (SIGCONT). Frozen
    before the leadership's first probe (a ``pg_locks`` statement) or after it (the
    periodic probe: a bare Sync on psycopg, started without a task)."""
    lock, rec = candidates.recorded("slow", health_interval_s=0.3, health_timeout_s=0.3)
    pid = await lead_and_probe(lock, probes_before)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        await rec.wait_state(S.RECONNECTING, timeout=5)
        figures("demoted after the backend froze", time.monotonic() - stopped_at, "s")
        assert not lock.is_leader
        await asyncio.sleep(0.5)  # well past health_timeout_s: still waiting, not lost
        assert lock.state is S.RECONNECTING
    finally:
        os.kill(pid, signal.SIGCONT)
    await rec.wait_state(S.LEADER, timeout=5)
    assert lock.backend_pid == pid  # the same session: the lock was held all along
    assert "lost" not in rec.names()
    assert lock.statistics().losses == 0
    probes = lock.statistics().probes
    await eventually(lambda: lock.statistics().probes > probes, 5, "another probe")
    # and it goes on probing
    assert lock.is_leader
    beliefs.report().assert_safe()


async def test_a_backend_frozen_past_tcp_user_timeout_loses_the_lock(
    candidates: Candidates,
    beliefs: BeliefLog,
    figures: Figures,
) -> None:
    """A periodic probe that stays unanswered past ``tcp_user_timeout_s`` (after which
    the server would drop a silent session) ends the leadership with ``on_lost``; the
    late probe is bounded although it was started without a task."""
    lock, rec = candidates.recorded(
        "frozen", health_interval_s=0.3, health_timeout_s=0.3,
        tcp_user_timeout_s=1.5, auto_reacquire=False,
    )  # fmt: skip
    pid = await lead_and_probe(lock, 2)  # past the pg_locks probe: a periodic one is next
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        await rec.wait_event("lost", timeout=10)
        lost_after = time.monotonic() - stopped_at
        figures("on_lost after the backend froze", lost_after, "s")
        assert 1.5 <= lost_after < 5.0  # not before the late probe's bound; soon after
        assert not lock.is_leader
    finally:
        os.kill(pid, signal.SIGCONT)
    assert lock.statistics().losses == 1
    beliefs.report().assert_safe()


async def test_step_down_while_a_periodic_probe_is_in_flight(
    candidates: Candidates,
    beliefs: BeliefLog,
) -> None:
    """A step-down asked while a periodic probe waits for its answer (the backend frozen,
    the probe not late yet) releases the lock once the probe has answered: no loss, and
    the lock is free on the server."""
    lock, rec = candidates.recorded("busy", health_interval_s=0.2, health_timeout_s=2.0)
    pid = await lead_and_probe(lock, 2)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(0.4)  # the next probe is sent and unanswered
        assert lock.is_leader  # not late yet
        stepping = asyncio.ensure_future(lock.step_down(timeout_s=10))
        await asyncio.sleep(0.2)  # kept: the step-down meets the stopped server
    finally:
        os.kill(pid, signal.SIGCONT)
    async with asyncio.timeout(5):
        await stepping
    assert not lock.is_leader
    assert "released" in rec.names()
    assert "lost" not in rec.names()
    assert pid not in await candidates.holders()
    beliefs.report().assert_safe()
