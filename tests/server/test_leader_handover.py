"""Choosing who leads: ``hand_over(to=...)`` and ``priority=``.

PostgreSQL grants a released advisory lock to the first session in its queue; a targeted
hand-over makes every other candidate that is granted the lock meanwhile let it go again
before it announces anything, so that the lock reaches the target. No candidate but the
target may ever report ``on_acquired``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgleaderlock import HandOverError, LeaderLock, LockOptions, Participation, current_leader
from support.poll import eventually
from support.server import dsn_to_url
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Long waits on the server: a follower stays queued (its wait ends every second, and it
# queues again at once; one that stepped down queues again a second later).
FAST: dict[str, Any] = timings(
    retry_s=1.0, health_interval_s=0.2, load_plugins=False, watch_interval_s=30.0
)


class Candidates:
    def __init__(self, url: str, keys: tuple[int, int], schema: str) -> None:
        self.url, self.keys, self.schema = url, keys, schema
        self.locks: dict[str, LeaderLock] = {}
        self.acquired: list[str] = []  # identities, in the order of their on_acquired

    def add(self, identity: str, **kw: Any) -> LeaderLock:
        lock = LeaderLock(
            self.url,
            *self.keys,
            **lock_args(
                {**FAST, **kw},
                options=LockOptions(
                    participation=Participation(identity=identity, schema=self.schema)
                ),
            ),
        )
        lock.on_acquired(functools.partial(self.acquired.append, identity))
        self.locks[identity] = lock
        return lock

    def leader(self) -> LeaderLock | None:
        return next((lock for lock in self.locks.values() if lock.is_leader), None)

    async def waiting(self) -> set[str]:
        leader = self.leader() or next(iter(self.locks.values()))
        return {
            p.info.identity or "" for p in await leader.participants() if p.waiting and p.eligible
        }

    async def close(self) -> None:
        for lock in self.locks.values():
            await lock.shutdown()


@pytest.fixture
async def candidates(pg_dsn: str, keys: tuple[int, int], schema: str) -> AsyncIterator[Candidates]:
    group = Candidates(dsn_to_url(pg_dsn), keys, schema)
    try:
        yield group
    finally:
        await group.close()


async def test_hand_over_lands_on_the_chosen_replica(candidates: Candidates) -> None:
    rng = random.Random()
    for name in ("a", "b", "c", "d"):
        lock = candidates.add(name)
        await lock.start()
        if name == "a":
            assert await lock.wait_for_leadership(10)
    trials = 20
    for trial in range(trials):
        leader = candidates.leader()
        assert leader is not None
        others = {n for n in candidates.locks if n != leader.identity}
        await eventually(
            functools.partial(_all_waiting, candidates, others), what=f"all queued ({trial})"
        )
        target = rng.choice(sorted(others))
        before = len(candidates.acquired)
        await leader.hand_over(to=target)
        new = candidates.locks[target]
        assert await new.wait_for_leadership(10), (trial, target)
        # Only the target announced leadership: nobody else's on_acquired ran.
        assert candidates.acquired[before:] == [target], (trial, candidates.acquired[before:])
    assert len(candidates.acquired) == trials + 1


async def _all_waiting(candidates: Candidates, names: set[str]) -> bool:
    return names <= await candidates.waiting()


async def test_hand_over_refuses_a_replica_that_is_not_waiting(candidates: Candidates) -> None:
    a = candidates.add("a")
    await a.start()
    assert await a.wait_for_leadership(10)
    with pytest.raises(HandOverError, match="not waiting"):
        await a.hand_over(to="nobody")
    with pytest.raises(HandOverError, match="own identity"):
        await a.hand_over(to="a")  # not a silent no-op
    b = candidates.add("b", eligible=False)
    await b.start()
    with pytest.raises(HandOverError, match="not waiting"):
        await a.hand_over(to="b")  # an observer never waits
    with pytest.raises(HandOverError, match="not leading"):
        await b.hand_over(to="a")
    assert a.is_leader


async def test_a_preferred_candidate_takes_over_once(candidates: Candidates) -> None:
    told: list[str | None] = []
    observer = candidates.add("obs", eligible=False)
    observer.on_leader_changed(lambda info: told.append(info and info.identity))
    await observer.start()
    low = candidates.add("low", priority=1, handover_delay_s=0.05)
    await low.start()
    assert await low.wait_for_leadership(10)
    mid = candidates.add("mid", priority=1, handover_delay_s=0.05)  # equal: no hand-over
    await mid.start()
    high = candidates.add("high", priority=5, handover_delay_s=0.05)
    await high.start()
    assert await high.wait_for_leadership(10)
    await asyncio.sleep(0.5)  # room for a wrong second move, if there were one
    assert candidates.acquired == ["low", "high"]
    await eventually(lambda: told[-1:] == ["high"])
    # Who leads, as an observer reads it: "low", then "high"; never "mid", though it is
    # first in the server's queue and is granted the lock for a moment while it passes
    # the reserved grant on (the next test holds that moment still).
    seen = [t for t in told if t is not None]
    assert seen[0] == "low"
    assert seen[-1] == "high"
    assert set(seen) <= {"low", "high"}


async def test_a_candidate_passing_a_reserved_grant_on_is_not_reported_as_leader(
    candidates: Candidates, pg_dsn: str, keys: tuple[int, int], schema: str
) -> None:
    """The moment a candidate holds the lock between its grant and letting it go to the
    reserved target, held still: a session with a trusted participant row ("mid"),
    queued before the target, is granted the lock by the hand-over and keeps it. While
    the reservation counts, readers report no leader, not "mid"; once it lets go, the
    target."""
    a = candidates.add("a")
    await a.start()
    assert await a.wait_for_leadership(10)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as mid:
        await mid.execute(
            f'INSERT INTO "{schema}".pgleaderlock_participants (key1, key2, pid,'
            " backend_start, identity, eligible, writer, updated_at)"
            " SELECT %s, %s, a.pid, a.backend_start, 'mid', true, current_user, now()"
            " FROM pg_stat_activity a WHERE a.pid = pg_backend_pid()",
            keys,
        )
        queued = asyncio.create_task(mid.execute("SELECT pg_advisory_lock(%s, %s)", keys))
        await eventually(functools.partial(_all_waiting, candidates, {"mid"}), what="mid queued")
        target = candidates.add("t")
        await target.start()
        await eventually(functools.partial(_all_waiting, candidates, {"mid", "t"}), what="t queued")
        await a.hand_over(to="t")
        await asyncio.wait_for(queued, 10)  # "mid" holds the lock now
        for _ in range(3):
            leader = await current_leader(pg_dsn, keys, participants_schema=schema)
            assert leader is None, leader  # not "mid" (on the old reader: "mid")
        await mid.execute("SELECT pg_advisory_unlock(%s, %s)", keys)
        assert await target.wait_for_leadership(10)
    leader = await current_leader(pg_dsn, keys, participants_schema=schema)
    assert leader is not None
    assert leader.identity == "t"


async def test_equal_priorities_never_hand_over(candidates: Candidates) -> None:
    """Three candidates of one priority, their leaders looking often (every notification
    and every 0.1 s tick of the watch): leadership never moves."""
    for name in ("a", "b", "c"):
        lock = candidates.add(name, priority=3, handover_delay_s=0.0, watch_interval_s=0.1)
        await lock.start()
        if name == "a":
            assert await lock.wait_for_leadership(10)
    await asyncio.sleep(2.0)  # kept: 20 watch intervals, for a wrong hand-over to show
    assert candidates.acquired == ["a"]


REPLICA = Path(__file__).with_name("leader_replica.py")


class Replica:
    """A replica process (``leader_replica.py``)."""

    def __init__(self, proc: asyncio.subprocess.Process, identity: str) -> None:
        self.proc, self.identity = proc, identity

    @classmethod
    async def start(cls, dsn: str, name: str, identity: str, priority: int, schema: str) -> Replica:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(REPLICA), dsn, name, identity, str(priority), schema,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"ready", line
        return cls(proc, identity)

    async def terminate(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(self.proc.wait(), 30) == 0

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def test_a_rolling_restart_moves_leadership_at_most_three_times(
    pg_dsn: str, schema: str
) -> None:
    """Three replica processes, each started with a higher priority than any before
    (the newest is preferred), restarted one after the other (SIGTERM, start again):
    leadership moves to each new replica once, and at most three times in all."""
    name = f"rolling-{uuid.uuid4().hex[:8]}"
    told: list[tuple[int, str | None] | None] = []  # the leader, as an observer is told
    observer = LeaderLock.from_name(
        name,
        pg_dsn,
        **lock_args(
            FAST,
            options=LockOptions(
                participation=Participation(identity="observer", eligible=False, schema=schema)
            ),
        ),
    )
    observer.on_leader_changed(
        lambda info: told.append(None if info is None else (info.pid, info.identity))
    )
    replicas: list[Replica] = []
    try:
        await observer.start()
        for i in range(3):
            replicas.append(await Replica.start(pg_dsn, name, f"r{i}-1", i + 1, schema))
        await eventually(
            lambda: told[-1:] != [] and told[-1] is not None and told[-1][1] == "r2-1",
            20,
            "the most preferred leads",
        )
        start = len(told)
        for i in range(3):  # oldest first
            await replicas[i].terminate()
            replicas[i] = await Replica.start(pg_dsn, name, f"r{i}-2", 4 + i, schema)
            await eventually(functools.partial(_leads, observer, f"r{i}-2"), 20, f"r{i}-2 leads")
        await eventually(lambda: told[-1] is not None and told[-1][1] == "r2-2", 20)
        leaders = [leader[0] for leader in told[start - 1 :] if leader is not None]
        moves = sum(1 for a, b in itertools.pairwise(leaders) if a != b)
        assert moves == 3, told[start - 1 :]  # one per new replica, never more
    finally:
        for replica in replicas:
            replica.kill()
            await replica.proc.wait()
        await observer.shutdown()


async def _leads(observer: LeaderLock, identity: str) -> bool:
    info = await observer.leader()
    return info is not None and info.identity == identity
