"""Faults against fencing: no stale leader's write ever commits.

K candidate processes (``fenced_worker.py``) compete for one fencing lock on a throwaway
server. Only while it leads, each runs transactions that fence, increment a shared
counter and log ``(value, term)``. The test injects faults at random on whoever holds the
lock: ``pg_terminate_backend`` of its lock session, SIGKILL of its process (a new
candidate replaces it), SIGSTOP for 10-500 ms (often frozen mid-transaction, and then
often with its lock session terminated while it is stopped), and a few fast server
restarts. Afterwards the committed log, ordered by value, must have non-decreasing terms:
no transaction of an older leadership committed after one of a newer leadership.

The same run with the workers skipping ``fence()`` (they trust their lock's leadership
alone) must show such a stale commit, so the check can fail. Besides the random faults,
each run starts with the classic case, constructed step by step: the leader is held
inside a transaction, after its fence point (or before it), and frozen; its lock session
is terminated; the next leader takes over; then the old leader resumes and commits.
With fencing the next leader's term bump waits for the frozen transaction (or the old
leader's fence fails); without it, the old leader's write lands after the new leader's.

``PGLEADERLOCK_FENCING_FAULT_S`` sets how long the random faults run in each variant
(default 25 s).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any

import psycopg
import pytest

from pgleaderlock import lock_keys
from pgleaderlock.core.keys import key_to_oid
from pgleaderlock.testing.candidate import CandidateEvent
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.fenced import FencedWorker
from support.fixture_types import Figures
from support.started import all_closed

pytestmark = [pytest.mark.throwaway, pytest.mark.timeout(180)]

K = 4
RUN_S = float(os.environ.get("PGLEADERLOCK_FENCING_FAULT_S", "25"))
RESTARTS = 2

FAULTS = ("terminate", "stop", "kill")
WEIGHTS = (0.55, 0.35, 0.10)
"""The random faults besides the restarts: pg_terminate_backend of the lock session,
SIGSTOP/SIGCONT (with the lock session terminated while stopped, 60% of the time),
SIGKILL."""

HOLDER = (
    "SELECT l.pid, a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
    " AND l.classid = %s::int8::oid AND l.objid = %s::int8::oid"
)
WAITING_HOLDER = HOLDER + " AND a.wait_event_type = 'Lock'"
IN_TRANSACTION = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
    " AND state LIKE 'idle in transaction%%'"
)

Admin = psycopg.AsyncConnection[tuple[Any, ...]]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@dataclass
class Episode:
    """One constructed case: the leader held inside a transaction at ``point`` (before
    or after its fence point) and frozen, its lock session terminated."""

    point: str
    term: int
    outcome: str = ""  # committed | fenced
    value: int | None = None
    next_waited: bool = False  # the next leader's term bump was seen waiting for it
    newer_committed: bool = False  # a newer term committed while it was frozen


@dataclass
class Outcome:
    """The committed log, ordered by value."""

    commits: int
    terms: int
    stale: list[tuple[int, int, str, int]]  # value, term, worker, newest term before it
    contiguous: bool


def analyse(rows: list[tuple[int, int, str]], counter: int) -> Outcome:
    stale: list[tuple[int, int, str, int]] = []
    newest: int | None = None
    for value, term, worker in rows:
        if newest is not None and term < newest:
            stale.append((value, term, worker, newest))
        newest = term if newest is None else max(newest, term)
    values = [r[0] for r in rows]
    return Outcome(
        commits=len(rows),
        terms=len({r[1] for r in rows}),
        stale=stale,
        contiguous=values == list(range(1, counter + 1)),
    )


@dataclass
class Run:
    """K workers against one lock on ``pg``, and the faults injected on them."""

    pg: ThrowawayPostgres
    fence: bool
    stderr: IO[str]
    lock_name: str = field(default_factory=lambda: unique("fault-fencing"))
    terms_table: str = field(default_factory=lambda: unique("terms"))
    counter: str = field(default_factory=lambda: unique("counter"))
    log: str = field(default_factory=lambda: unique("log"))
    workers: dict[str, FencedWorker] = field(default_factory=dict)
    killed: list[FencedWorker] = field(default_factory=list)
    spawning: set[asyncio.Task[None]] = field(default_factory=set)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    frozen_mid_transaction: int = 0
    admin: Admin | None = None
    spawned: int = 0

    @property
    def keys(self) -> tuple[int, int]:
        return lock_keys(self.lock_name)

    # ------------------------------------------------------------ the server

    async def query(self, sql: str | bytes, params: tuple[object, ...] = ()) -> list[Any]:
        """Run ``sql`` on the admin session, reconnecting across server restarts."""
        for _ in range(100):
            try:
                if self.admin is None or self.admin.closed:
                    self.admin = await psycopg.AsyncConnection.connect(
                        self.pg.dsn, autocommit=True, connect_timeout=5
                    )
                async with asyncio.timeout(10):
                    cur = await self.admin.execute(
                        sql.encode() if isinstance(sql, str) else sql, params
                    )
                    return await cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if self.admin is not None:
                    await self.admin.close()
                self.admin = None
                await asyncio.sleep(0.1)
        raise AssertionError(f"the admin session could not run {sql!r}")

    async def setup(self) -> None:
        await self.query(f"CREATE TABLE {self.counter} (id int PRIMARY KEY, value int8 NOT NULL)")
        await self.query(f"INSERT INTO {self.counter} VALUES (1, 0)")
        await self.query(
            f"CREATE TABLE {self.log} (value int8 PRIMARY KEY, term int8 NOT NULL,"
            " worker text NOT NULL)"
        )
        await asyncio.gather(*(self.spawn() for _ in range(K)))

    async def holder(self, *, waiting: bool = False) -> tuple[FencedWorker, int] | None:
        """The worker whose lock session holds the lock, and that session's pid."""
        sql = WAITING_HOLDER if waiting else HOLDER
        for pid, app in await self.query(sql, tuple(key_to_oid(k) for k in self.keys)):
            worker = self.workers.get(str(app).removeprefix("fenced-"))
            if worker is not None and worker.running:
                return worker, int(pid)
        return None

    async def terminate(self, backend: int) -> None:
        await self.query("SELECT pg_terminate_backend(%s)", (backend,))

    async def newer_committed(self, term: int) -> bool:
        rows = await self.query(f"SELECT count(*) FROM {self.log} WHERE term > %s", (term,))
        return bool(rows[0][0])

    # ------------------------------------------------------------ the workers

    async def spawn(self) -> None:
        self.spawned += 1
        name = f"w{self.spawned}"
        args = [
            f"--fencing-table={self.terms_table}",
            f"--counter={self.counter}",
            f"--log={self.log}",
            *([] if self.fence else ["--no-fence"]),
        ]
        worker = FencedWorker(name, self.pg.dsn, self.keys, args, self.stderr)
        self.workers[name] = worker
        await worker.start()

    def respawn(self) -> None:
        task = asyncio.get_running_loop().create_task(self.spawn())
        self.spawning.add(task)
        task.add_done_callback(self.spawning.discard)

    async def leader(self, timeout_s: float = 30.0) -> tuple[FencedWorker, int]:
        """The worker that holds the lock and says it leads (waits for one, bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = await self.holder()
            if found is not None and found[0].is_leader:
                return found
            assert time.monotonic() < deadline, "no leader"
            await asyncio.sleep(0.01)

    async def settle(self) -> None:
        """Let the replacements of killed workers start and one leader take over."""
        if self.spawning:
            await asyncio.gather(*self.spawning)
        await asyncio.sleep(0.5)
        await self.leader()

    async def close(self) -> list[int | None]:
        """Stop every worker; their exit codes."""
        if self.spawning:
            await asyncio.gather(*self.spawning, return_exceptions=True)
        workers = list(self.workers.values())
        for worker in workers:
            worker.signal(signal.SIGCONT)
        codes = await asyncio.gather(*(w.stop(timeout_s=15) for w in workers))
        if self.admin is not None:
            await self.admin.close()
        return codes

    def events(self, name: str) -> list[CandidateEvent]:
        workers = [*self.workers.values(), *self.killed]
        return [e for w in workers for e in w.events if e.event == name]

    # ------------------------------------------------------------ the classic case

    async def episode(self, point: str) -> Episode:
        """Hold the leader inside a transaction at ``point``, SIGSTOP it, terminate its
        lock session; with fencing after the fence point, wait until the next leader's
        term bump waits for the frozen transaction; else until a newer term committed.
        Then SIGCONT and let the old leader finish its transaction."""
        worker, backend = await self.leader()
        since = time.monotonic()
        await worker.send(f"hold {point}")
        held = await worker.first(("holding",), since)
        episode = Episode(point, int(held.data["term"]))
        worker.signal(signal.SIGSTOP)
        try:
            await self.terminate(backend)
            deadline = time.monotonic() + 10
            while not (episode.next_waited or episode.newer_committed):
                assert time.monotonic() < deadline, f"episode {episode}: no next leader"
                await asyncio.sleep(0.01)
                if self.fence and point == "after":
                    waiting = await self.holder(waiting=True)
                    episode.next_waited = waiting is not None and waiting[0] is not worker
                else:
                    episode.newer_committed = await self.newer_committed(episode.term)
            if episode.next_waited:  # it keeps waiting, and commits nothing, meanwhile
                await asyncio.sleep(0.2)
                assert await self.holder(waiting=True) is not None
                assert not await self.newer_committed(episode.term)
        finally:
            worker.signal(signal.SIGCONT)
        resumed = time.monotonic()
        await worker.send("go")
        done = await worker.first(("committed", "fenced"), resumed)
        episode.outcome = done.event
        episode.value = done.data.get("value")
        self.faults[f"episode ({point} the fence point)"] += 1
        return episode

    # ------------------------------------------------------------ random faults

    async def random_faults(self, duration_s: float) -> None:
        started = time.monotonic()
        end = started + duration_s
        restarts = [started + duration_s * (i + 1) / (RESTARTS + 1) for i in range(RESTARTS)]
        while time.monotonic() < end:
            await asyncio.sleep(random.uniform(0.01, 0.05))  # let the leader work
            if restarts and time.monotonic() >= restarts[0]:
                restarts.pop(0)
                await asyncio.to_thread(self.pg.restart, "fast")
                self.faults["server restart"] += 1
                continue
            found = await self.holder()
            if found is None:
                continue
            worker, backend = found
            kind = random.choices(FAULTS, WEIGHTS)[0]
            if kind == "terminate":
                await self.terminate(backend)
            elif kind == "kill":
                await worker.kill()
                self.killed.append(self.workers.pop(worker.name))
                self.respawn()
            else:
                kind = await self.stop(worker, backend)
            self.faults[kind] += 1

    async def stop(self, worker: FencedWorker, backend: int) -> str:
        worker.signal(signal.SIGSTOP)
        try:
            work = f"fenced-{worker.name}-work"
            if (await self.query(IN_TRANSACTION, (work,)))[0][0]:
                self.frozen_mid_transaction += 1
            terminate = random.random() < 0.6
            if terminate:
                await self.terminate(backend)
            await asyncio.sleep(random.uniform(0.01, 0.5))
        finally:
            worker.signal(signal.SIGCONT)
        return "stop + terminate" if terminate else "stop"

    async def outcome(self) -> Outcome:
        rows = await self.query(f"SELECT value, term, worker FROM {self.log} ORDER BY value")
        counter = (await self.query(f"SELECT value FROM {self.counter}"))[0][0]
        return analyse([(int(v), int(t), str(w)) for v, t, w in rows], int(counter))


@pytest.fixture
async def run_factory(
    throwaway_pg: ThrowawayPostgres, children_log: IO[str]
) -> AsyncIterator[Callable[[bool], Awaitable[Run]]]:
    async with all_closed() as runs:

        async def make(fence: bool) -> Run:
            run = Run(throwaway_pg, fence, children_log)
            runs.append(run)
            await run.setup()
            return run

        yield make


@pytest.mark.parametrize("fence", [True, False], ids=["fencing-on", "fencing-off"])
async def test_no_stale_commit_under_random_faults(
    fence: bool,
    run_factory: Callable[[bool], Awaitable[Run]],
    figures: Figures,
) -> None:
    """With fencing, 0 stale commits under hundreds of random faults and in the classic
    case; without it, the classic case (at least) commits a stale write."""
    started = time.monotonic()
    run = await run_factory(fence)
    episodes = [await run.episode("after")]
    if fence:
        episodes.append(await run.episode("before"))
    await run.random_faults(RUN_S)
    await run.settle()
    episodes.append(await run.episode("after"))  # the classic case again, after all that
    assert await run.close() == [0] * len(run.workers), "a worker died on its own"
    outcome = await run.outcome()

    faults = sum(n for kind, n in run.faults.items() if not kind.startswith("episode"))
    print(f"faults by kind: {dict(run.faults)}")
    print(f"episodes: {episodes}")
    figures("random faults", faults, "faults")
    for kind in (*FAULTS, "stop + terminate", "server restart"):
        figures(f"fault: {kind}", run.faults[kind], "faults")
    figures("stops that froze a transaction", run.frozen_mid_transaction, "stops")
    figures("commits", outcome.commits, "commits")
    figures("terms seen", outcome.terms, "terms")
    figures("fenced (FencedError, rolled back)", len(run.events("fenced")), "transactions")
    figures("stale commits", len(outcome.stale), "commits")
    figures("run time", time.monotonic() - started, "s")
    if outcome.stale:
        print(
            f"first stale commits (value, term, worker, newest term before): {outcome.stale[:10]}"
        )

    assert outcome.contiguous, "every committed increment is logged exactly once"
    assert all(run.faults[kind] for kind in (*FAULTS, "server restart")), run.faults
    if fence:
        assert outcome.stale == [], f"{len(outcome.stale)} stale commits with fencing"
        after = [e for e in episodes if e.point == "after"]
        assert all(e.next_waited and e.outcome == "committed" for e in after), episodes
        assert [e.outcome for e in episodes if e.point == "before"] == ["fenced"], episodes
    else:
        assert all(e.newer_committed and e.outcome == "committed" for e in episodes), episodes
        stale_values = {s[0] for s in outcome.stale}
        assert all(e.value in stale_values for e in episodes), (episodes, outcome.stale[:10])
