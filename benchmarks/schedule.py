"""Schedule ledger benchmark: how punctual a slot is, what a claim costs, and whether
the next slot is still on time after the leader crashes.

- **lateness**: a ``Scheduler`` job every ``--interval`` seconds on one leader; each
  run's ``run.late_s`` (server clock: the claim's ``clock_timestamp()`` minus the slot).
- **claim**: ``Scheduler.claim`` of past slots one after another (one statement on the
  lock's session, queued through the lock's runner), against a raw psycopg ``SELECT 1``
  round trip measured in the same run.
- **guard**: a worker's ``SlotGuard.admit`` (one short session: connect, check the runs
  table, one ``UPDATE``, close) for the first copy of a slot and for a second copy (the
  skip), its ``admit_sync`` from a thread as a Celery worker calls it, and a bare
  psycopg connect and close for comparison.
- **after a crash**: a leader process (``every(1)``) is SIGKILLed at a given phase of
  the second; the follower in this process takes over, and the first slot it runs is
  measured (how late after its time). Phases: 0.5 s before the tick, and 5 ms before
  it (the failover then overlaps the tick).

Usage::

    python benchmarks/schedule.py                    # throwaway cluster
    python benchmarks/schedule.py --dsn postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import psycopg
from _common import database, fmt_ms, interrupt_on_signals, markdown_table, summarize

from pgleaderlock import Fencing, FixedInterval, LeaderLock, LockOptions
from pgleaderlock.schedule import Every, Run, Scheduler, SlotGuard

FAST: dict[str, Any] = {
    "retry_strategy": FixedInterval(0.05),
    "health_interval_s": 1.0,
    "options": LockOptions(fencing=Fencing(enabled=True), load_plugins=False),
}
"""The locks here all fence (a Scheduler needs it)."""

LEADER = textwrap.dedent(
    """
    import asyncio, os, sys
    from pgleaderlock import Fencing, FixedInterval, LeaderLock, LockOptions
    from pgleaderlock.schedule import Scheduler

    async def main():
        options = LockOptions(fencing=Fencing(enabled=True), load_plugins=False)
        lock = LeaderLock.from_name(sys.argv[1], dsn=os.environ["PG_DSN"],
                                    retry_strategy=FixedInterval(0.05), options=options)
        sched = Scheduler(lock)

        @sched.every(seconds=1)
        async def tick(run):
            pass

        async with lock, sched:
            await lock.wait_for_leadership(10)
            print("leading", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def lateness(dsn: str, interval: float, count: int) -> list[float]:
    lock = LeaderLock.from_name(f"bench-sched-{uuid.uuid4().hex[:8]}", dsn=dsn, **FAST)
    sched = Scheduler(lock)
    late: list[float] = []
    done = asyncio.Event()

    @sched.every(seconds=interval)
    async def tick(run: Run) -> None:
        late.append(run.late_s)
        if len(late) >= count:
            done.set()

    async with lock, sched:
        await asyncio.wait_for(done.wait(), interval * count + 30)
    return late


async def claims(dsn: str, count: int) -> dict[str, list[float]]:
    lock = LeaderLock.from_name(f"bench-claim-{uuid.uuid4().hex[:8]}", dsn=dsn, **FAST)
    sched = Scheduler(lock)

    async def never(run: Run) -> None:  # timed by hand below
        raise AssertionError

    job = sched.add(never, Every(dt.timedelta(seconds=3600 * 24 * 365)), name="claims")
    found: dict[str, list[float]] = {key: [] for key in ("claim", "flush", "no flush", "insert")}
    async with lock:
        await lock.wait_for_leadership(10)
        base = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
        name = sched.schedule_name("claims")
        await sched.settle(job, base)  # registers the schedule, checks the tables
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("CREATE TEMP TABLE durable_insert (a int)")
            await conn.execute("CREATE TABLE IF NOT EXISTS bench_durable_insert (a int)")
            claim = sched.ledger.claim.format(*[f"%(v{i})s" for i in range(9)])
            key1, key2 = lock.keys
            for i in range(count):
                slot = base + dt.timedelta(seconds=i)
                started = time.perf_counter()
                run = await sched.claim(job, slot)
                found["claim"].append(time.perf_counter() - started)
                assert run is not None
                # The same statement on a plain connection, with and without the flush.
                for key, sync, offset in (("flush", "on", 10**6), ("no flush", "off", 2 * 10**6)):
                    await conn.execute(f"SET synchronous_commit = {sync}")
                    values = dict(enumerate((name, base + dt.timedelta(seconds=offset + i),
                                             run.term, key1, key2, "bench", False, None,
                                             "running")))  # fmt: skip
                    started = time.perf_counter()
                    await conn.execute(claim, {f"v{k}": v for k, v in values.items()})
                    found[key].append(time.perf_counter() - started)
                await conn.execute("SET synchronous_commit = on")
                started = time.perf_counter()
                await conn.execute("INSERT INTO bench_durable_insert VALUES (1)")
                found["insert"].append(time.perf_counter() - started)
            await conn.execute("DROP TABLE bench_durable_insert")
            await conn.execute("DELETE FROM public.pgleaderlock_runs WHERE schedule = %s", (name,))
    await sched.shutdown()
    return found


async def after_crash(dsn: str, phase_before_tick_s: float, trials: int) -> list[float]:
    """For each trial: the first slot the follower runs after the leader's SIGKILL, how
    late (s)."""
    results: list[float] = []
    attempts = 0
    while len(results) < trials and attempts < 3 * trials:
        attempts += 1
        name = f"bench-crash-{uuid.uuid4().hex[:8]}"
        leader = subprocess.Popen(
            [sys.executable, "-c", LEADER, name],
            stdout=subprocess.PIPE,
            env={**os.environ, "PG_DSN": dsn},
            text=True,
        )
        try:
            assert leader.stdout is not None
            line = await asyncio.to_thread(leader.stdout.readline)
            assert line.strip() == "leading", line
            lock = LeaderLock.from_name(name, dsn=dsn, **FAST)
            sched = Scheduler(lock)
            first: list[Run] = []
            ran = asyncio.Event()

            @sched.every(seconds=1)
            async def tick(run: Run, first: list[Run] = first, ran: asyncio.Event = ran) -> None:
                first.append(run)
                ran.set()

            async with lock, sched:
                await asyncio.sleep(1.5)  # the follower waits on the server
                now = time.time()
                await asyncio.sleep((1 - phase_before_tick_s - now % 1.0) % 1.0)
                killed = time.time()
                leader.send_signal(signal.SIGKILL)
                await asyncio.wait_for(ran.wait(), 10)
            slot = first[0].slot.timestamp()
            if slot <= killed:
                # A busy machine woke this process after the tick: the kill was not
                # before it, so this is not the scenario measured. Try again.
                print(f"after_crash: kill {killed - slot:.4f} s after the tick, again",
                      file=sys.stderr)  # fmt: skip
                continue
            results.append(first[0].late_s)
        finally:
            leader.kill()
            leader.wait()
            if leader.stdout is not None:
                leader.stdout.close()
    return results


async def guards(dsn: str, count: int) -> dict[str, list[float]]:
    name = f"bench-guard-{uuid.uuid4().hex[:8]}:send"
    base = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
    slots = [base + dt.timedelta(seconds=i) for i in range(2 * count)]
    guard = SlotGuard(dsn)
    found: dict[str, list[float]] = {key: [] for key in ("first", "copy", "sync", "connect")}
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await guard.admit(name, base)  # creates the table if need be
        await conn.execute(
            "INSERT INTO public.pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
            " SELECT %s, s, 1, 'sent', now() FROM unnest(%s::timestamptz[]) AS s",
            (name, slots),
        )
        try:
            for slot in slots[:count]:
                started = time.perf_counter()
                assert await guard.admit(name, slot)
                found["first"].append(time.perf_counter() - started)
                started = time.perf_counter()
                assert not await guard.admit(name, slot)
                found["copy"].append(time.perf_counter() - started)
                started = time.perf_counter()
                await (await psycopg.AsyncConnection.connect(dsn)).close()
                found["connect"].append(time.perf_counter() - started)

            def in_thread() -> None:
                for slot in slots[count:]:
                    started = time.perf_counter()
                    assert guard.admit_sync(name, slot)
                    found["sync"].append(time.perf_counter() - started)

            await asyncio.to_thread(in_thread)
        finally:
            await conn.execute("DELETE FROM public.pgleaderlock_runs WHERE schedule = %s", (name,))
    return found


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--slots", type=int, default=50)
    parser.add_argument("--claims", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--guards", type=int, default=200)
    args = parser.parse_args()
    interrupt_on_signals()
    with database(args.dsn) as dsn:
        late = summarize(await lateness(dsn, args.interval, args.slots))
        cost = {key: summarize(values) for key, values in (await claims(dsn, args.claims)).items()}
        guard = {key: summarize(values) for key, values in (await guards(dsn, args.guards)).items()}
        crash = {
            phase: summarize(await after_crash(dsn, phase, args.trials)) for phase in (0.5, 0.005)
        }
    rows = [
        [f"slot start, every {args.interval:g} s (late after its time)", late.n,
         fmt_ms(late.median), fmt_ms(late.p95), fmt_ms(late.max)],
    ]  # fmt: skip
    for key, label in (
        ("claim", "claim (Scheduler.claim: one statement, one durable commit)"),
        ("flush", "the claim statement on a plain connection"),
        ("no flush", "the same, synchronous_commit=off (no WAL flush)"),
        ("insert", "a durable one-row INSERT (the disk's flush, same run)"),
    ):
        c = cost[key]
        rows.append([label, c.n, fmt_ms(c.median), fmt_ms(c.p95), fmt_ms(c.max)])
    for key, label in (
        ("first", "SlotGuard.admit, the first copy (connect, check, UPDATE, close)"),
        ("copy", "SlotGuard.admit, a later copy (skipped)"),
        ("sync", "SlotGuard.admit_sync from a thread (as a Celery worker)"),
        ("connect", "a bare psycopg connect and close (same run)"),
    ):
        g = guard[key]
        rows.append([label, g.n, fmt_ms(g.median), fmt_ms(g.p95), fmt_ms(g.max)])
    for phase, summary in crash.items():
        rows.append([
            f"first slot after SIGKILL {phase * 1000:g} ms before a tick (late)", summary.n,
            fmt_ms(summary.median), fmt_ms(summary.p95), fmt_ms(summary.max),
        ])  # fmt: skip
    print(markdown_table(["measure", "n", "median", "p95", "max"], rows))


if __name__ == "__main__":
    asyncio.run(main())
