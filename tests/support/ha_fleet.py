"""A fleet of fenced candidates on one DSN, for the HA tier (``tests/ha``) and the
Patroni benchmark (``benchmarks/ha.py --scenario patroni``).

``Fleet(kind, dsn)`` runs, in this process:

- ``size`` fenced ``LeaderLock`` candidates on one pair of keys, each with a
  ``Scheduler`` whose job ``tick`` runs every second and writes its slot through
  ``run.transaction`` (failed runs retried: ``Policy(retry=Retry(...))``, every missed
  slot caught up, an interrupted one run again);
- two fenced ``Coordinator`` replicas of one group with one name ``x``, whose worker
  moves a checkpoint 1, 2, 3, ... writing each position in the same transaction.

Every leadership belief goes to a ``BeliefLog``; every ``on_acquired`` is noted with its
term. ``check()`` reads the final primary and returns what went wrong (nothing: an empty
list).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pgleaderlock import Coordinator, LeaderLock, WorkerContext
from pgleaderlock.schedule import Policy, Retry, Run, Scheduler
from pgleaderlock.testing.beliefs import BeliefLog
from support.schedule import sched_every
from support.timings import lock_args, timings

__all__ = ["Fleet", "execute"]

TIMINGS: dict[str, Any] = timings(
    retry_s=1.0,
    health_interval_s=1.0,
    health_timeout_s=1.0,
    connect_timeout_s=3.0,
    command_timeout_s=5.0,
    load_plugins=False,
)
_CONNECT: dict[str, Any] = {"connect_timeout": 3, "options": "-c statement_timeout=5s"}


async def execute(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """One statement in autocommit; its rows (none for a command)."""
    async with await psycopg.AsyncConnection[tuple[Any, ...]].connect(
        dsn, autocommit=True, **_CONNECT
    ) as conn:
        cur = await conn.execute(sql.encode(), params or None)
        return await cur.fetchall() if cur.description else []


@dataclass
class Fleet:
    """Candidates of one DSN kind (see the module docstring)."""

    kind: str
    dsn: str
    keys: tuple[int, int]
    size: int = 3
    retry_strategy: Any = None
    beliefs: BeliefLog = field(default_factory=BeliefLog)
    acquired: list[tuple[float, str, int]] = field(default_factory=list)
    locks: list[LeaderLock] = field(default_factory=list)
    scheds: list[Scheduler] = field(default_factory=list)
    coords: list[Coordinator] = field(default_factory=list)
    positions: int = 0

    @property
    def ticks(self) -> str:
        return f"ha_ticks_{self.kind}"

    @property
    def moved(self) -> str:
        return f"ha_positions_{self.kind}"

    async def setup(self) -> None:
        await execute(self.dsn, f"DROP TABLE IF EXISTS {self.ticks}, {self.moved}")
        await execute(self.dsn, f"CREATE TABLE {self.ticks} (slot timestamptz, term int8)")
        await execute(self.dsn, f"CREATE TABLE {self.moved} (position int8, term int8)")

    def _lock(self, name: str) -> LeaderLock:
        settings = {**TIMINGS, "fencing": True}
        if self.retry_strategy is not None:
            settings["retry_strategy"] = self.retry_strategy
        else:
            del settings["retry_strategy"]  # the library's default
        # One name for every replica (the ledger's schedule is ``<lock name>:tick``).
        lock = LeaderLock(self.dsn, *self.keys, name=self.kind, **lock_args(settings))
        self.beliefs.attach(lock, name)

        def acquired() -> None:
            term = lock.term
            assert term is not None
            self.acquired.append((time.monotonic(), name, term))

        lock.on_acquired(acquired)
        return lock

    async def tick(self, run: Run) -> None:
        async with (
            await psycopg.AsyncConnection[tuple[Any, ...]].connect(self.dsn, **_CONNECT) as conn,
            run.transaction(conn) as term,
        ):
            await conn.execute(
                f"INSERT INTO {self.ticks} VALUES (%s, %s)".encode(), (run.slot, term)
            )

    async def worker(self, ctx: WorkerContext) -> None:
        """Moves the checkpoint one position every 0.2 s; each position is written in
        the same fenced transaction. Connection errors: try again (the position comes
        from the checkpoint, so a lost commit is redone, a kept one is not)."""
        while True:
            try:
                async with (
                    await psycopg.AsyncConnection[tuple[Any, ...]].connect(
                        self.dsn, **_CONNECT
                    ) as conn,
                    conn.transaction(),
                ):
                    position = (await ctx.load_checkpoint(conn) or 0) + 1
                    await conn.execute(
                        f"INSERT INTO {self.moved} VALUES (%s, %s)".encode(),
                        (position, await ctx.fence(conn)),
                    )
                    await ctx.save_checkpoint(conn, position)
                self.positions = position
            except psycopg.OperationalError:
                pass
            await asyncio.sleep(0.2)

    async def start(self) -> None:
        retry = Retry(max_attempts=30, backoff_s=0.5, max_backoff_s=1.0)
        policy = Policy(catch_up="all", interrupted="rerun", retry=retry)
        for i in range(self.size):
            lock = self._lock(f"{self.kind}-{i}")
            sched = Scheduler(lock)
            sched.add(self.tick, sched_every(1), name="tick", policy=policy)
            self.locks.append(lock)
            self.scheds.append(sched)
        for _ in range(2):
            settings = {**TIMINGS, "fencing": True}
            del settings["retry_strategy"]
            coord = Coordinator(self.dsn, group=f"ha-{self.kind}", **lock_args(settings))
            coord.add("x", self.worker)
            self.coords.append(coord)
        for lock, sched in zip(self.locks, self.scheds, strict=True):
            await lock.start()
            await sched.start()
        for coord in self.coords:
            await coord.start()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.gather(*(s.shutdown() for s in self.scheds), return_exceptions=True)
        await asyncio.gather(
            *(lock.shutdown(timeout_s=15) for lock in self.locks),
            *(coord.shutdown() for coord in self.coords),
            return_exceptions=True,
        )

    def server_going_down(self) -> None:
        """Note in the belief log that the server is about to end the leader's session
        (a switchover or a crash): a follower queued there may be granted the lock for
        the few ms until its own session ends, before the leader can know (a terminate
        overlap, bounded; see ``BeliefLog``)."""
        for i, lock in enumerate(self.locks):
            if lock.is_leader:
                self.beliefs.fault("terminate", f"{self.kind}-{i}")

    def leader(self) -> LeaderLock | None:
        leading = [lock for lock in self.locks if lock.is_leader]
        return leading[0] if leading else None

    def acquired_after(self, t: float) -> float | None:
        """When the first leadership after ``t`` began, or None."""
        return min((at for at, _, _ in self.acquired if at > t), default=None)

    async def check(self) -> list[str]:
        """What went wrong, read on the final primary (through this fleet's DSN)."""
        problems: list[str] = []
        report = self.beliefs.report()
        try:
            report.assert_safe()
        except AssertionError as exc:
            problems.append(f"{self.kind}: {exc}")
        terms = [term for _, _, term in sorted(self.acquired)]
        if any(b <= a for a, b in itertools.pairwise(terms)):
            problems.append(f"{self.kind}: terms not strictly increasing: {terms}")
        name = self.scheds[0].schedule_name("tick")
        rows = await execute(
            self.dsn,
            "SELECT slot, outcome, attempt FROM public.pgleaderlock_runs"
            " WHERE schedule = %s ORDER BY slot",
            (name,),
        )
        ticks = await execute(self.dsn, f"SELECT slot, count(*) FROM {self.ticks} GROUP BY slot")
        written = dict(ticks)
        done = [slot for slot, outcome, _ in rows if outcome == "done"]
        if not done:
            problems.append(f"{self.kind}: no slot done")
            return problems
        slots = [slot for slot, _, _ in rows if slot <= done[-1]]
        gaps = [(a, b) for a, b in itertools.pairwise(slots) if (b - a).total_seconds() != 1]
        if gaps:
            problems.append(f"{self.kind}: slots missing between {gaps}")
        not_done = [(s, o, a) for s, o, a in rows if s <= done[-1] and o != "done"]
        if not_done:
            problems.append(f"{self.kind}: slots not done: {not_done}")
        twice = {s: c for s, c in written.items() if c != 1}
        if twice:
            problems.append(f"{self.kind}: slots written more than once: {twice}")
        if set(written) != set(done):
            problems.append(
                f"{self.kind}: written {sorted(set(written) ^ set(done))} differ from done"
            )
        positions = [
            p for (p,) in await execute(self.dsn, f"SELECT position FROM {self.moved} ORDER BY 1")
        ]
        if positions != list(range(1, len(positions) + 1)):
            problems.append(f"{self.kind}: checkpoint positions not 1..n once: {positions}")
        return problems
