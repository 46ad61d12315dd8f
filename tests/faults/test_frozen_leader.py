"""A wedged or frozen leader loses its lock within a bound, fencing included.

Two candidate processes on one lock; the leader is then wedged while the follower waits
on the server:

- ``blocked-loop``: its event loop is blocked by a synchronous call (``time.sleep``);
- ``sigstop``: the whole process is frozen (a debugger, a stuck container);
- ``sigstop-fenced``: the same, with a fenced transaction open on its own connection
  (``fenced_worker.py``): without a bounded grace the next leader's term bump would wait
  for it for as long as the process stays frozen.

The client's kernel keeps answering TCP keepalives, so only the lease ends the session:
the follower must lead within ``lease_s`` of the frozen leader's last probe (plus
``fencing_grace_s`` with a fenced transaction open), the frozen transaction must never
commit, and the frozen leader must report ``on_lost`` as soon as it runs again. The
beliefs checker allows overlap only in that window: from the next leader's start until
just after the frozen one runs again (see ``docs/guarantees.md``, "The lease").

Each runs on psycopg and asyncpg, with the library's default timings (lease 10 s) and
with the knobs lowered.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any

import psycopg
import pytest

from pgleaderlock import LeaderLock, LockOptions, Session, ThreadedLeaderLock, Timing, lock_keys
from pgleaderlock.core.config import default_lease_s
from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.candidate import CandidateEvent, CandidateOptions, CandidateProcess
from support.fenced import FencedWorker
from support.fixture_types import Figures

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Admin = psycopg.AsyncConnection[tuple[Any, ...]]

SLACK_S = 1.5
"""What the test allows on top of the documented bound: process scheduling on a busy
machine, the follower's own event loop (the bound itself is the server's timer)."""


@dataclass(frozen=True)
class Timings:
    """The knobs of a run; ``None`` keeps the library's default."""

    id: str
    health_interval_s: float | None = None
    health_timeout_s: float | None = None
    lease_s: float | None = None
    fencing_grace_s: float | None = None

    @property
    def lease(self) -> float:
        return self.lease_s or default_lease_s(
            self.health_interval_s or 5.0, self.health_timeout_s or 2.0
        )

    @property
    def grace(self) -> float:
        return self.fencing_grace_s or 2.0

    def candidate(self, backend: str) -> CandidateOptions:
        if self.health_interval_s is None:
            return CandidateOptions.library_defaults(backend=backend)
        return CandidateOptions(
            health_interval_s=self.health_interval_s,
            health_timeout_s=self.health_timeout_s,
            lease_s=self.lease_s,
            backend=backend,
        )

    def worker_args(self, backend: str) -> list[str]:
        args = [f"--backend={backend}"]
        if self.health_interval_s is None:
            return [*args, "--defaults"]
        return [*args, f"--lease={self.lease_s}", f"--fencing-grace={self.fencing_grace_s}"]


DEFAULTS = Timings("defaults")
LOWERED = Timings("lowered", health_interval_s=0.5, health_timeout_s=0.5, lease_s=1.5,
                  fencing_grace_s=0.5)  # fmt: skip


@dataclass
class Fenced:
    """The tables a fenced worker writes to, on the test server."""

    admin: Admin
    terms: str
    counter: str
    log: str

    @property
    def args(self) -> list[str]:
        return [
            f"--fencing-table={self.terms}",
            f"--counter={self.counter}",
            f"--log={self.log}",
        ]

    async def rows(self) -> list[tuple[int, int, str]]:
        cur = await self.admin.execute(
            f"SELECT value, term, worker FROM {self.log} ORDER BY value".encode()
        )
        return [(int(v), int(t), str(w)) for v, t, w in await cur.fetchall()]


@pytest.fixture
async def fenced(admin: Admin) -> AsyncIterator[Callable[[], Awaitable[Fenced]]]:
    """``await fenced()``: tables of this test's own for a fenced worker (dropped after)."""
    made: list[Fenced] = []

    async def make() -> Fenced:
        tag = uuid.uuid4().hex[:10]
        tables = Fenced(admin, f"frozen_terms_{tag}", f"frozen_counter_{tag}", f"frozen_log_{tag}")
        made.append(tables)
        await admin.execute(
            f"CREATE TABLE {tables.counter} (id int PRIMARY KEY, value int8 NOT NULL)".encode()
        )
        await admin.execute(f"INSERT INTO {tables.counter} VALUES (1, 0)".encode())
        await admin.execute(
            f"CREATE TABLE {tables.log} (value int8 PRIMARY KEY, term int8 NOT NULL,"
            " worker text NOT NULL)".encode()
        )
        return tables

    try:
        yield make
    finally:
        for tables in made:
            for table in (tables.terms, tables.counter, tables.log):
                await admin.execute(f"DROP TABLE IF EXISTS {table}".encode())


SCENARIOS = ("blocked-loop", "sigstop", "sigstop-fenced")


@pytest.mark.parametrize("timings", [DEFAULTS, LOWERED], ids=lambda t: t.id)
@pytest.mark.parametrize("backend", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_a_frozen_leader_loses_its_lock_within_the_lease(
    scenario: str,
    backend: str,
    timings: Timings,
    pg_dsn: str,
    fenced: Callable[[], Awaitable[Fenced]],
    children_log: IO[str],
    figures: Figures,
) -> None:
    beliefs = BeliefLog()
    keys = lock_keys(f"frozen-{uuid.uuid4().hex[:10]}")
    fencing = scenario == "sigstop-fenced"
    tables = await fenced() if fencing else None
    bound = timings.lease + (timings.grace if fencing else 0.0)

    def child(name: str) -> CandidateProcess:
        if tables is not None:
            args = [*timings.worker_args(backend), *tables.args]
            return FencedWorker(name, pg_dsn, keys, args, children_log, beliefs)
        options = timings.candidate(backend)
        return CandidateProcess(
            name, pg_dsn, *keys, options=options, beliefs=beliefs, stderr=children_log
        )

    old, new = child("old"), child("new")
    try:
        await old.start()
        await old.wait_event("acquired", timeout_s=30)
        await new.start()
        await new.wait_event(  # it tried, and waits on the server from then on
            "state", timeout_s=30, where=lambda e: e.data.get("new") == "acquiring"
        )

        held: CandidateEvent | None = None
        if scenario == "blocked-loop":
            await old.send(f"block {bound + 4}")
            frozen_at = (await old.wait_event("blocking")).t
            beliefs.fault("freeze", "old", frozen_at)
        else:
            if fencing:
                await old.send("hold after")  # its next transaction stops after fence()
                held = await old.wait_event("holding")
            frozen_at = beliefs.fault("freeze", "old").t
            old.signal(signal.SIGSTOP)

        led = await new.wait_event("acquired", since=frozen_at, timeout_s=bound + 15)
        failover = led.t - frozen_at

        if scenario == "blocked-loop":
            thawed_at = (await old.wait_event("unblocked", timeout_s=bound + 15)).t
            beliefs.fault("thaw", "old", thawed_at)
        else:
            await asyncio.sleep(0.3)  # frozen a little longer, while the other leads
            thawed_at = beliefs.fault("thaw", "old").t
            old.signal(signal.SIGCONT)
            if fencing:
                await old.send("go")  # the frozen transaction tries to commit
        lost = await old.wait_event("lost", since=frozen_at, timeout_s=10)
        outcome = None
        if held is not None:  # how the frozen transaction ended once it ran again
            assert isinstance(old, FencedWorker)
            outcome = await old.first(("committed", "work_error", "fenced"), held.t, 15)
    finally:
        old.signal(signal.SIGCONT)
        codes = await asyncio.gather(old.stop(), new.stop())

    figures("failover after the freeze", failover, "s")
    figures("documented bound", bound, "s")
    figures("on_lost after running again", lost.t - thawed_at, "ms")
    assert list(codes) == [0, 0]
    assert failover <= bound + SLACK_S, (
        f"the follower led {failover:.3f} s after the freeze (bound {bound:g} s)"
    )
    assert lost.t >= thawed_at, "on_lost came from the frozen process, after it ran again"
    report = beliefs.report()
    print(report.format())
    report.assert_safe()
    assert len(report.frozen_overlaps) == 1, report.format()  # the window, and only it
    if tables is not None:
        assert held is not None
        assert outcome is not None
        assert outcome.event != "committed", f"the frozen transaction committed: {outcome}"
        held_term = int(held.data["term"])
        rows = await tables.rows()
        newer = [value for value, term, _ in rows if term > held_term]
        assert newer, "the new leader committed fenced work"
        assert not [row for row in rows if row[1] == held_term and row[0] > min(newer)], (
            "a write of the frozen term committed after the new term's"
        )


@pytest.mark.parametrize("backend", ["psycopg", "asyncpg"])
async def test_a_threaded_lock_whose_loop_blocks_loses_its_lock_within_the_lease(
    backend: str,
    pg_dsn: str,
    children_log: IO[str],
    figures: Figures,
) -> None:
    """A ``ThreadedLeaderLock`` whose own thread's event loop blocks (a synchronous
    callback, say) for longer than the lease: the server frees the lock, a follower in
    another process leads within the lease, and the threaded lock reports ``on_lost`` as
    soon as its loop runs again. (A blocked *caller* thread does not block the lock's
    thread: that lock keeps probing, and its lock.)"""
    beliefs = BeliefLog()
    keys = lock_keys(f"frozen-threaded-{uuid.uuid4().hex[:10]}")
    timings = LOWERED
    lock = ThreadedLeaderLock(
        LeaderLock(
            pg_dsn, *keys, health_interval_s=0.5, options=LockOptions(session=Session(backend=backend), timing=Timing(health_timeout_s=0.5, lease_s=timings.lease_s), load_plugins=False),
        )
    )  # fmt: skip
    lost = threading.Event()
    lock.lock.on_lost(lost.set)
    beliefs.attach(lock.lock, "threaded")
    new = CandidateProcess(
        "new", pg_dsn, *keys, options=timings.candidate(backend), beliefs=beliefs,
        stderr=children_log,
    )  # fmt: skip
    blocked: list[float] = []

    def block() -> None:  # runs on the lock's thread, and blocks its loop
        blocked.append(time.monotonic())
        time.sleep(timings.lease + 3)
        blocked.append(time.monotonic())

    try:
        await asyncio.to_thread(lock.start)
        assert await asyncio.to_thread(lock.wait_for_leadership, 10)
        await new.start()
        await new.wait_event(
            "state", timeout_s=30, where=lambda e: e.data.get("new") == "acquiring"
        )
        loop = lock.loop
        assert loop is not None
        loop.call_soon_threadsafe(block)
        while not blocked:
            await asyncio.sleep(0.005)
        beliefs.fault("freeze", "threaded", blocked[0])
        led = await new.wait_event("acquired", since=blocked[0], timeout_s=timings.lease + 15)
        assert await asyncio.to_thread(lost.wait, timings.lease + 15)
        beliefs.fault("thaw", "threaded", blocked[1])
    finally:
        await asyncio.to_thread(lock.shutdown, 15)
        code = await new.stop()
    failover = led.t - blocked[0]
    figures("failover after the lock thread blocked", failover, "s")
    assert code == 0
    assert failover <= timings.lease + SLACK_S
    assert led.t < blocked[1], "the follower led while the lock's thread was blocked"
    report = beliefs.report()
    report.assert_safe()
    assert len(report.frozen_overlaps) == 1, report.format()
