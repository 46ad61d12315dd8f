"""What followers write into the server's log, read from the server's own log file.

Two clusters of this test's own, side by side: one with default logging, one with
``log_lock_waits = on``. On each, a leader and three followers (default timings) for
60 s, with one leadership change halfway (the leader shuts down). Followers wait on the
server in one piece (no ``lock_timeout`` expiring every retry delay, each expiry an
ERROR and the statement), so:

- default logging: no ERROR (or worse) line at all while they run;
- ``log_lock_waits = on``: at most one line per follower per leadership change (a
  wait that began logs "still waiting" once, the winner "acquired").

A ``Semaphore(slots=2)`` too (issue 33), on a cluster of its own with default logging: two
holders and five followers for 60 s, one holder shutting down halfway. Its followers
queue for the semaphore's gate, or wait for a slot as its watcher, in one piece; the
gate's holder only tries locks and counts its queue. Before, each follower's wait ended
in a ``lock_timeout`` every retry delay: dozens of ERROR lines in the minute.

The lines written when the locks shut down (a dropped wait's "connection to client
lost") are not counted: that is not steady state.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Callable, Iterator

import pytest

from pgleaderlock import LeaderLock, LockOptions, Semaphore
from pgleaderlock.testing.postgres import ThrowawayPostgres

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(180)]

RUN_S = 60.0
FOLLOWERS = 3
SLOTS = 2
SEMAPHORE_FOLLOWERS = 5
_SEVERE = re.compile(r"\b(ERROR|FATAL|PANIC):")
_LOCK_WAIT = re.compile(r"LOG:  process (\d+) (?:still waiting for|acquired) \w+ on advisory lock")
"""A ``log_lock_waits`` entry (its ``STATEMENT`` line, the same entry, is not counted)."""


@pytest.fixture
def clusters() -> Iterator[dict[str, ThrowawayPostgres]]:
    with (
        ThrowawayPostgres() as default,
        ThrowawayPostgres(settings={"log_lock_waits": "on"}) as lock_waits,
    ):
        yield {"default": default, "log_lock_waits": lock_waits}


@pytest.fixture
def cluster() -> Iterator[ThrowawayPostgres]:
    with ThrowawayPostgres() as pg:
        yield pg


async def run_election(
    pg: ThrowawayPostgres,
    make: Callable[[str], LeaderLock] | None = None,
    holders: int = 1,
    followers: int = FOLLOWERS,
) -> tuple[str, list[int]]:
    """``holders`` leaders (``make(dsn)``, default a ``LeaderLock``) and ``followers``
    followers for RUN_S, one leader shutting down halfway. Returns the server log written
    meanwhile, and the followers' backend pids."""
    if make is None:
        make = _lock
    start = pg.log_path.stat().st_size
    leaders = [make(pg.dsn) for _ in range(holders)]
    for leader in leaders:
        await leader.start()
        assert await leader.wait_for_leadership(10)
    waiting = [make(pg.dsn) for _ in range(followers)]
    try:
        for follower in waiting:
            await follower.start()
        await asyncio.sleep(RUN_S / 2)
        await leaders[0].shutdown()  # the one leadership change
        await asyncio.sleep(RUN_S / 2)
        assert sum(f.is_leader for f in waiting) == 1
        assert all(leader.is_leader for leader in leaders[1:])
        pids = [f.backend_pid for f in waiting]
        assert None not in pids
        await asyncio.sleep(0.5)  # the server writes its lines
        with pg.log_path.open("rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
    finally:
        await asyncio.gather(*(f.shutdown() for f in (*waiting, *leaders)))
    return text, [int(p) for p in pids if p is not None]


def _lock(dsn: str) -> LeaderLock:
    return LeaderLock.from_name("report", dsn, options=LockOptions(load_plugins=False))


def _semaphore(dsn: str) -> LeaderLock:
    return Semaphore(dsn, "report", slots=SLOTS, options=LockOptions(load_plugins=False))


async def test_followers_keep_the_server_log_quiet(
    clusters: dict[str, ThrowawayPostgres],
) -> None:
    (default, _), (lock_waits, pids) = await asyncio.gather(
        run_election(clusters["default"]), run_election(clusters["log_lock_waits"])
    )
    severe = [line for line in default.splitlines() if _SEVERE.search(line)]
    print(f"default logging: {len(severe)} ERROR/FATAL lines in {RUN_S:g} s")
    assert severe == [], "\n".join(severe[:10])
    severe = [line for line in lock_waits.splitlines() if _SEVERE.search(line)]
    assert severe == [], "\n".join(severe[:10])
    per_pid: collections.Counter[int] = collections.Counter()
    for match in _LOCK_WAIT.finditer(lock_waits):
        per_pid[int(match.group(1))] += 1
    print(f"log_lock_waits = on: lock wait lines per follower {dict(per_pid)}")
    changes = 1
    for pid in pids:
        assert per_pid[pid] <= changes + 1, (pid, per_pid)  # the first wait, and the change
    assert set(per_pid) <= set(pids), per_pid  # the leader never waited
    assert sum(per_pid.values()) >= FOLLOWERS  # the log is read: every first wait shows


async def test_semaphore_followers_keep_the_server_log_quiet(cluster: ThrowawayPostgres) -> None:
    text, _ = await run_election(cluster, _semaphore, SLOTS, SEMAPHORE_FOLLOWERS)
    severe = [line for line in text.splitlines() if _SEVERE.search(line)]
    print(f"semaphore, default logging: {len(severe)} ERROR/FATAL lines in {RUN_S:g} s")
    assert severe == [], "\n".join(severe[:10])
