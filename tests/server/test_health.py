"""Health checks (pgleaderlock.health) and the escalation of errors that keep a lock from
leading, on the shared server: a wedged lock fails liveness, a healthy follower passes,
and an unknown host or a role's CONNECTION LIMIT 0 escalates and fails readiness."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgleaderlock import LeaderLock, LockOptions, LockState, ThreadedLeaderLock, Timing, health
from support.poll import eventually, eventually_sync
from support.server import Admin
from support.timings import lock_args, timings

pytestmark = pytest.mark.timeout(90)

FAST: dict[str, Any] = timings(retry_s=0.05, health_interval_s=0.2, load_plugins=False)


def _records(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "pgleaderlock" and getattr(r, "pgleaderlock", {}).get("event") == event
    ]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = record.pgleaderlock  # type: ignore[attr-defined]
    return fields


def test_a_lock_whose_event_loop_is_blocked_fails_liveness_within_its_bound(
    pg_dsn: str, keys: tuple[int, int], figures: Callable[..., None]
) -> None:
    """The lock runs in its own thread's event loop; a call that blocks that loop
    (``threading.Event.wait``, as a ``time.sleep`` would) makes liveness and readiness
    fail, checked from this thread, once the task is ``stall_s`` behind its schedule;
    both pass again once the loop runs."""
    stall_s = 0.5
    threaded = ThreadedLeaderLock(LeaderLock(pg_dsn, *keys, **lock_args(FAST)))
    release = threading.Event()
    with threaded:
        assert threaded.wait_for_leadership(10)
        assert health.live(threaded, stall_s=stall_s).ok
        assert health.check(threaded, stall_s=stall_s).ok
        loop = threaded.loop
        assert loop is not None
        blocked_at = time.monotonic()
        loop.call_soon_threadsafe(release.wait, 60)
        try:
            failed_at = eventually_sync(
                lambda: not health.live(threaded, stall_s=stall_s).ok, 20, "liveness failed"
            )
            report = health.check(threaded, stall_s=stall_s)
        finally:
            release.set()
        figures("wedge noticed after the loop blocked", failed_at - blocked_at)
        assert not report.ok
        assert report.reasons[0].startswith("wedged:"), report.reasons
        assert report.details["stalled_s"] >= stall_s
        eventually_sync(lambda: health.live(threaded, stall_s=stall_s).ok, 20, "alive again")
        assert threaded.wait_for_leadership(10)  # it goes on leading (or leads again)
        assert health.check(threaded, stall_s=stall_s).ok


async def test_a_healthy_follower_passes_while_it_waits_on_the_server(
    pg_dsn: str, keys: tuple[int, int]
) -> None:
    """A follower waiting on the server (2 s per wait, far longer than ``stall_s``) takes
    no step for seconds, and is healthy all along: the bound is its own schedule, not
    the time since its last step. Readiness ignores leadership unless asked."""
    stall_s = 0.3
    leader = LeaderLock(pg_dsn, *keys, **lock_args(FAST))
    follower = LeaderLock(
        pg_dsn, *keys, **lock_args({**FAST, **timings(retry_s=2.0, health_interval_s=0.2)})
    )
    async with leader:
        assert await leader.wait_for_leadership(10)
        async with follower:
            await eventually(lambda: follower.statistics().failed_attempts >= 1, 10, "waits")
            deadline = time.monotonic() + 3.0  # more than one wait on the server
            checks = 0
            while time.monotonic() < deadline:
                for lock in (leader, follower):
                    for report in (
                        health.live(lock, stall_s=stall_s),
                        health.check(lock, stall_s=stall_s),
                    ):
                        assert report.ok, (lock, report)
                        checks += 1
                await asyncio.sleep(0.05)
            assert follower.statistics().failed_attempts >= 2  # a wait ended meanwhile
            assert follower.state is not LockState.LEADER
            assert checks > 100
            report = health.check(follower, require_leader=True)
            assert not report.ok
            assert len(report.reasons) == 1
            assert report.reasons[0].startswith("not the leader"), report.reasons
            assert health.check(leader, require_leader=True).ok
    stopped = health.check(follower)
    assert not stopped.ok
    assert stopped.reasons == ("stopped",)
    assert health.live(follower).ok  # a stopped lock is not wedged: restarting won't help


async def test_an_unknown_host_escalates_instead_of_repeating_and_fails_readiness(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Errors that keep the lock from leading: the first is logged at ERROR, repeats at
    DEBUG, and after ``escalate_after_s`` a ``lock_failing`` summary says for how long
    and what to check; ``failing_since`` is set, and readiness fails after
    ``failing_s`` (liveness does not: the lock runs on time)."""
    caplog.set_level(logging.DEBUG, logger="pgleaderlock")
    host = f"otel-no-such-host-{random.randrange(10**9)}.invalid"
    lock = LeaderLock(
        f"postgresql://postgres@{host}/test",
        1,
        2,
        **lock_args(FAST, options=LockOptions(timing=Timing(escalate_after_s=0.5))),
    )
    async with lock:
        await eventually(lambda: _records(caplog, "lock_failing"), 20, "lock_failing")
        stats = lock.statistics()
        assert stats.failing_since is not None
        assert stats.errors >= 3
        summary = _fields(_records(caplog, "lock_failing")[0])
        assert summary["failing_for_s"] >= 0.5
        assert summary["errors"] >= 3
        assert host in summary["error"]
        assert "does not resolve" in summary["check"]
        assert health.live(lock).ok
        report = health.check(lock, failing_s=0.5)
        assert not report.ok
        assert report.reasons[0].startswith("failing for"), report.reasons
        assert host in report.reasons[0]
        assert report.details["failing_for_s"] >= 0.5
    errors_logged = [r for r in _records(caplog, "db_error") if r.levelno >= logging.ERROR]
    repeats = [r for r in _records(caplog, "db_error") if r.levelno == logging.DEBUG]
    assert len(errors_logged) == 1, [r.getMessage() for r in errors_logged]
    assert len(repeats) >= 2


async def test_a_role_at_its_connection_limit_escalates_and_recovers(
    pg_dsn: str, admin: Admin, keys: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    """A role with ``CONNECTION LIMIT 0``: the server refuses every session, the lock
    escalates with a hint about connection limits; once the limit is lifted the lock
    leads, ``failing_since`` is cleared and ``failing_ended`` says how long it failed."""
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    role = f"otel_limit_{random.randrange(10**9)}"
    await admin.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 0")
    try:
        dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=role)
        lock = LeaderLock(
            dsn, *keys, **lock_args(FAST, options=LockOptions(timing=Timing(escalate_after_s=0.3)))
        )
        async with lock:
            await eventually(lambda: _records(caplog, "lock_failing"), 20, "lock_failing")
            summary = _fields(_records(caplog, "lock_failing")[0])
            assert "too many connections" in summary["error"]
            assert "CONNECTION LIMIT" in summary["check"]
            assert not health.check(lock, failing_s=0.3).ok
            await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
            assert await lock.wait_for_leadership(10)
            assert lock.statistics().failing_since is None
            assert health.check(lock, failing_s=0.3).ok
            ended = _fields(_records(caplog, "failing_ended")[0])
            assert ended["failed_for_s"] >= 0.3
    finally:
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
