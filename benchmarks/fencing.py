"""Fencing: what ``fence()`` costs a transaction, what the term bump costs a failover, and
what ``acquire_delay_s`` buys after a terminated backend.

Three measurements, each printed as a Markdown table:

1. **fence() per transaction** (``cost``): a small real transaction on loopback
   (``BEGIN; UPDATE counter SET value = value + 1 RETURNING value; INSERT INTO log ...;
   COMMIT``) with and without ``lock.fence(conn)`` as its first statement, on psycopg
   and on asyncpg, interleaved in a random order, ``--transactions`` of each. Reported:
   the median transaction with and without, their difference (the fence's added time),
   the median of the ``fence()`` call itself timed inside the transaction, and its
   share of the fenced transaction. A third variant with the raw driver's ``SELECT 1``
   in place of the fence shows the floor: one round trip.
2. **Failover after SIGKILL** (``failover``): K candidate processes
   (``pgleaderlock.testing.candidate``, library defaults, wait mode) with
   ``fencing=True`` and K without, on two locks; the trials alternate between them. The
   leader process is SIGKILLed; the time is kill -> the new leader's ``acquired`` event
   (``on_acquired`` ran). The difference of the medians is what the term bump adds.
3. **acquire_delay_s after a terminated backend** (``delay``): K fencing candidates per
   delay (0, 5, 10, 20 ms by default), trials interleaved across delays;
   ``pg_terminate_backend`` of the leader's lock session. The **double-belief window**
   is how long the old leader still believed it led (until its state left LEADER) after
   the new leader's ``on_acquired`` ran (0 when it let go first); also the time to the
   new leader. A group without fencing runs alongside, for reference.

Usage::

    python benchmarks/fencing.py                         # everything (about 3 minutes)
    python benchmarks/fencing.py --only cost --transactions 5000
    python benchmarks/fencing.py --no-fsync              # the throwaway cluster's fsync=off

Without ``--dsn`` a throwaway cluster is started, by default durable like a production
server (``fsync``, ``synchronous_commit`` and ``full_page_writes`` on: the term bump
commits with ``synchronous_commit=on`` and so waits for a WAL flush), and removed
afterwards. Every wait is bounded, and every process started here is killed on every
exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
from _common import (
    Summary,
    database,
    describe_machine,
    fmt_ms,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    server_info,
    summarize,
)

from pgleaderlock import Fencing, LeaderLock, LockOptions, lock_keys
from pgleaderlock.backends.base import (
    bump_term_statement,
    create_terms_statement,
    lock_timeout_ms,
)
from pgleaderlock.core.config import TermTable
from pgleaderlock.core.keys import key_to_oid
from pgleaderlock.testing.candidate import CandidateEvent, CandidateOptions, CandidateProcess
from support.server import dsn_to_url

SECTIONS = ("cost", "failover", "delay")
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs"


# ================================================================== 1. fence() cost


async def _tables(dsn: str) -> tuple[str, str]:
    counter, log = unique("bench_counter"), unique("bench_log")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f"CREATE TABLE {counter} (id int PRIMARY KEY, value int8)".encode())
        await conn.execute(f"INSERT INTO {counter} VALUES (1, 0)".encode())
        await conn.execute(
            f"CREATE TABLE {log} (value int8 PRIMARY KEY, term int8, variant text)".encode()
        )
    return counter, log


async def _drop(dsn: str, *tables: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for table in tables:
            await conn.execute(f"DROP TABLE IF EXISTS {table}".encode())


VARIANTS = ("plain", "fence", "select1")
"""The transaction as it is, with ``lock.fence(conn)`` first, and with the raw driver's
``SELECT 1`` first (one round trip: the floor of any extra statement)."""

Transaction = Callable[[str], Awaitable[float | None]]
"""One transaction of a variant; the duration of its extra first statement, if any."""


async def _psycopg_transaction(
    dsn: str, lock: LeaderLock, counter: str, log: str
) -> tuple[Transaction, Callable[[], Awaitable[None]]]:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=5)
    update = f"UPDATE {counter} SET value = value + 1 WHERE id = 1 RETURNING value".encode()
    insert = f"INSERT INTO {log} (value, term, variant) VALUES (%s, %s, %s)".encode()

    async def transaction(variant: str) -> float | None:
        extra_s = None
        async with conn.transaction():
            if variant != "plain":
                started = time.perf_counter()
                if variant == "fence":
                    await lock.fence(conn)
                else:
                    await conn.execute("SELECT 1")
                extra_s = time.perf_counter() - started
            cur = await conn.execute(update)
            row = await cur.fetchone()
            assert row is not None
            await conn.execute(insert, (row[0], lock.term, variant))
        return extra_s

    return transaction, conn.close


async def _asyncpg_transaction(
    dsn: str, lock: LeaderLock, counter: str, log: str
) -> tuple[Transaction, Callable[[], Awaitable[None]]]:
    conn = await asyncpg.connect(dsn_to_url(dsn), timeout=5)
    update = f"UPDATE {counter} SET value = value + 1 WHERE id = 1 RETURNING value"
    insert = f"INSERT INTO {log} (value, term, variant) VALUES ($1, $2, $3)"

    async def transaction(variant: str) -> float | None:
        extra_s = None
        async with conn.transaction():
            if variant != "plain":
                started = time.perf_counter()
                if variant == "fence":
                    await lock.fence(conn)
                else:
                    await conn.fetchval("SELECT 1")
                extra_s = time.perf_counter() - started
            value = await conn.fetchval(update)
            await conn.execute(insert, value, lock.term, variant)
        return extra_s

    async def close() -> None:
        await conn.close(timeout=5)

    return transaction, close


async def measure_cost(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """Section 1: plain, fenced and SELECT 1 transactions interleaved, per driver."""
    print(f"\n== fence() per transaction: {args.transactions} of each variant per driver")
    counter, log = await _tables(dsn)
    terms = unique("bench_terms")
    lock = LeaderLock.from_name(
        unique("bench-fence"), dsn, options=LockOptions(fencing=Fencing(enabled=True, table=terms))
    )
    results: dict[str, Any] = {}
    rows = []
    try:
        await lock.start()
        if not await lock.wait_for_leadership(10):
            raise RuntimeError("the benchmark's lock did not lead")
        for driver, make in (("psycopg", _psycopg_transaction), ("asyncpg", _asyncpg_transaction)):
            transaction, close = await make(dsn, lock, counter, log)
            total: dict[str, list[float]] = {v: [] for v in VARIANTS}
            extra: dict[str, list[float]] = {v: [] for v in VARIANTS}
            try:
                for _ in range(200):  # warm-up: connections, prepared statements, caches
                    for variant in VARIANTS:
                        await transaction(variant)
                for _ in range(args.transactions):
                    for variant in random.sample(VARIANTS, len(VARIANTS)):
                        started = time.perf_counter()
                        extra_s = await transaction(variant)
                        total[variant].append(time.perf_counter() - started)
                        if extra_s is not None:
                            extra[variant].append(extra_s)
            finally:
                await close()
            plain, fenced, select1 = (summarize(total[v]) for v in VARIANTS)
            fence, one = summarize(extra["fence"]), summarize(extra["select1"])
            added = fenced.median - plain.median
            rows.append(
                [
                    driver,
                    fmt_us(plain.median),
                    fmt_us(fenced.median),
                    fmt_us(added),
                    f"{fmt_us(fence.median)} / {fmt_us(fence.p95)}",
                    f"{fence.median / fenced.median:.0%}",
                    f"{fmt_us(select1.median - plain.median)} ({fmt_us(one.median)})",
                ]
            )
            results[driver] = {
                "transaction": {v: summarize(total[v]).as_dict() for v in VARIANTS},
                "statement": {v: summarize(extra[v]).as_dict() for v in VARIANTS if extra[v]},
                "fence_added_median_s": added,
            }
    finally:
        await lock.shutdown(timeout_s=10)
        await _drop(dsn, counter, log, terms)
    print()
    print(
        markdown_table(
            [
                "driver",
                "transaction: median",
                "with fence(): median",
                "added (difference of medians)",
                "fence() call: median / p95",
                "fence()'s share of the fenced transaction",
                "for reference, SELECT 1 instead: added (the call)",
            ],
            rows,
        )
    )
    return results


# ================================================================== candidate groups


class Group:
    """K candidate processes of one configuration, on a lock of their own."""

    def __init__(self, label: str, dsn: str, options: CandidateOptions, k: int) -> None:
        self.label, self.dsn, self.options, self.k = label, dsn, options, k
        self.keys = lock_keys(unique("bench-fencing"))
        self.live: list[CandidateProcess] = []
        self.spawned = 0

    async def spawn(self) -> None:
        self.spawned += 1
        child = CandidateProcess(
            f"{self.label}-{self.spawned}", self.dsn, *self.keys, options=self.options
        )
        self.live.append(child)
        await child.start()

    async def start(self) -> None:
        await asyncio.gather(*(self.spawn() for _ in range(self.k)))

    async def close(self) -> None:
        await asyncio.gather(*(c.kill() for c in self.live), return_exceptions=True)

    def _settled(self, c: CandidateProcess) -> bool:
        """Leads, or follows (its last attempt failed and it waits for the next one)."""
        if c.is_leader:
            return True
        names = [e.event for e in c.events if e.event in ("acquired", "acquire_failed", "lost")]
        return bool(names) and names[-1] == "acquire_failed"

    async def ready(self, timeout_s: float = 30.0) -> CandidateProcess:
        """Wait for exactly one leader and K-1 followers; the leader."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [c for c in self.live if c.running]
            leaders = [c for c in live if c.is_leader]
            if len(live) == self.k and len(leaders) == 1 and all(map(self._settled, live)):
                return leaders[0]
            if time.monotonic() > deadline:
                states = {c.name: [e.event for e in c.events[-4:]] for c in live}
                raise RuntimeError(f"{self.label}: no leader and K-1 followers: {states}")
            await asyncio.sleep(0.01)

    async def first(
        self,
        event: str,
        since: float,
        where: Callable[[CandidateProcess, CandidateEvent], bool] = lambda c, e: True,
        timeout_s: float = 10.0,
    ) -> tuple[CandidateProcess, CandidateEvent] | None:
        """The earliest ``event`` (by its own timestamp) of any candidate since ``since``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [
                (c, e)
                for c in self.live
                for e in c.events
                if e.event == event and e.t >= since and where(c, e)
            ]
            if found:
                await asyncio.sleep(0.02)  # a racing candidate's line may still be in flight
                found = [
                    (c, e)
                    for c in self.live
                    for e in c.events
                    if e.event == event and e.t >= since and where(c, e)
                ]
                return min(found, key=lambda ce: ce[1].t)
            await asyncio.sleep(0.002)
        return None


def _options(fencing: bool, table: str, delay_s: float | None = None) -> CandidateOptions:
    return CandidateOptions.library_defaults(
        quiet=True,
        fencing=fencing,
        fencing_table=table if fencing else None,
        acquire_delay_s=delay_s,
    )


# ================================================================== 2. failover


async def measure_failover(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """Section 2: SIGKILL of the leader, fencing on and off, trials alternating."""
    print(f"\n== failover after SIGKILL: K={args.candidates}, {args.failover_trials} trials each")
    table = unique("bench_terms")
    groups = {
        "fencing on": Group("on", dsn, _options(True, table), args.candidates),
        "fencing off": Group("off", dsn, _options(False, table), args.candidates),
    }
    times: dict[str, list[float]] = {label: [] for label in groups}
    try:
        await asyncio.gather(*(g.start() for g in groups.values()))
        for trial in range(1, args.failover_trials + 1):
            for label in random.sample(list(groups), len(groups)):
                group = groups[label]
                await group.ready()
                await asyncio.sleep(random.uniform(0.2, 0.5))
                leader = await group.ready()
                killed_at = await leader.kill()
                group.live.remove(leader)
                got = await group.first("acquired", killed_at)
                if got is None:
                    raise RuntimeError(f"{label}: no new leader within 10 s")
                times[label].append(got[1].t - killed_at)
                await group.spawn()
            print(
                f"  trial {trial}: "
                + ", ".join(f"{label} {fmt_ms(times[label][-1])}" for label in groups)
            )
    finally:
        await asyncio.gather(*(g.close() for g in groups.values()))
        await _drop(dsn, table)
    on, off = summarize(times["fencing on"]), summarize(times["fencing off"])
    rows = [[label, *_cells(summarize(values))] for label, values in times.items()]
    bump = await measure_bump(dsn, table, 300)
    rows.append(["(the term bump statement alone)", *_cells(bump["bump"])])
    rows.append(["(a SELECT 1 round trip, for reference)", *_cells(bump["select1"])])
    await _drop(dsn, table)
    print()
    print(markdown_table(["SIGKILL of the leader", "median", "p95", "max", "n"], rows))
    print(f"\nThe term bump adds {fmt_ms(on.median - off.median)} to the median failover.")
    figures = {label: summarize(v).as_dict() | {"values": v} for label, v in times.items()}
    return figures | {f"statement: {k}": v.as_dict() for k, v in bump.items()}


def _cells(s: Summary) -> list[str]:
    return [fmt_ms(s.median), fmt_ms(s.p95), fmt_ms(s.max), str(s.n)]


async def measure_bump(dsn: str, table: str, n: int) -> dict[str, Summary]:
    """The term bump statement alone (what a new leader runs before it is announced),
    on a connection of its own, against a ``SELECT 1`` round trip: ``n`` of each."""
    terms = TermTable(table)
    key1, key2 = lock_keys(unique("bench-bump"))
    times: dict[str, list[float]] = {"bump": [], "select1": []}
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(create_terms_statement(terms).template.encode())
        row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
        assert row is not None
        wait_ms = lock_timeout_ms(2.0)  # fencing_grace_s's default: nothing waits here
        bump = bump_term_statement(terms).sql(key1, key2, row[0], wait_ms).encode()
        for _ in range(n):
            for variant in random.sample(list(times), 2):
                started = time.perf_counter()
                await conn.execute(bump if variant == "bump" else b"SELECT 1")
                times[variant].append(time.perf_counter() - started)
    return {k: summarize(v) for k, v in times.items()}


# ================================================================== 3. acquire_delay_s


async def _holder(admin: psycopg.AsyncConnection[Any], keys: tuple[int, int]) -> int | None:
    cur = await admin.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        " AND classid = %s::int8::oid AND objid = %s::int8::oid",
        (key_to_oid(keys[0]), key_to_oid(keys[1])),
    )
    row = await cur.fetchone()
    return None if row is None else int(row[0])


async def measure_delay(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """Section 3: pg_terminate_backend of the leader's session, per acquire_delay_s, and
    without fencing for reference."""
    delays = [float(d) / 1000 for d in args.delays.split(",")]
    print(
        f"\n== acquire_delay_s after a terminated backend: delays {args.delays} ms and no "
        f"fencing, K={args.candidates}, {args.delay_trials} trials each"
    )
    table = unique("bench_terms")
    configs = {"no fencing": _options(False, table)}
    configs.update({f"{d * 1000:g} ms": _options(True, table, d) for d in delays})
    groups = {
        label: Group(label.replace(" ", "-"), dsn, options, args.candidates)
        for label, options in configs.items()
    }
    windows: dict[str, list[float]] = {label: [] for label in groups}
    to_new: dict[str, list[float]] = {label: [] for label in groups}
    took_back = dict.fromkeys(groups, 0)
    admin = await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=5)
    try:
        await asyncio.gather(*(g.start() for g in groups.values()))
        for trial in range(1, args.delay_trials + 1):
            for label in random.sample(list(groups), len(groups)):
                group = groups[label]
                await group.ready()
                await asyncio.sleep(random.uniform(0.2, 0.5))
                old = await group.ready()
                pid = await _holder(admin, group.keys)
                if pid is None or pid != old.backend_pid:
                    raise RuntimeError(f"{label}: the leader's session is not the holder")
                fault = time.monotonic()
                await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                got = await group.first("acquired", fault)
                if got is None:
                    raise RuntimeError(f"{label}: no new leader within 10 s")
                new, acquired = got
                if new is old:
                    took_back[label] += 1
                    continue
                ended = await group.first(
                    "state",
                    fault,
                    where=lambda c, e, old=old: c is old and e.data.get("old") == "leader",
                )
                if ended is None:
                    raise RuntimeError(f"{label}: the old leader never noticed")
                windows[label].append(max(0.0, ended[1].t - acquired.t))
                to_new[label].append(acquired.t - fault)
            print(
                f"  trial {trial}: "
                + ", ".join(
                    f"{label}: {fmt_ms(windows[label][-1]) if windows[label] else '-'}"
                    for label in groups
                )
            )
    finally:
        await asyncio.gather(*(g.close() for g in groups.values()))
        await admin.close()
        await _drop(dsn, table)
    rows = []
    for label in groups:
        w, n = summarize(windows[label]), summarize(to_new[label])
        overlapping = sum(1 for v in windows[label] if v > 0)
        rows.append(
            [
                label,
                fmt_ms(w.median),
                fmt_ms(w.p95),
                fmt_ms(w.max),
                f"{overlapping}/{w.n}",
                fmt_ms(n.median),
                fmt_ms(n.p95),
                str(took_back[label]),
            ]
        )
    print()
    print(
        markdown_table(
            [
                "acquire_delay_s",
                "double belief: median",
                "p95",
                "max",
                "trials with any",
                "to the new leader's on_acquired: median",
                "p95",
                "old leader took it back",
            ],
            rows,
        )
    )
    return {
        label: {
            "window": summarize(windows[label]).as_dict() | {"values": windows[label]},
            "to_new_leader": summarize(to_new[label]).as_dict(),
            "took_back": took_back[label],
        }
        for label in groups
    }


# ================================================================== main


async def run(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if "cost" in args.only:
        results["cost"] = await measure_cost(dsn, args)
    if "failover" in args.only:
        results["failover"] = await measure_failover(dsn, args)
    if "delay" in args.only:
        results["delay"] = await measure_delay(dsn, args)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/fencing.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="repeatable; default: all"
    )
    parser.add_argument(
        "--transactions", type=int, default=3000, help="of each kind per driver (3000)"
    )
    parser.add_argument("--failover-trials", type=int, default=40, help="per setting (40)")
    parser.add_argument("--delay-trials", type=int, default=40, help="per delay (40)")
    parser.add_argument("--delays", default="0,5,10,20", help="acquire_delay_s in ms (0,5,10,20)")
    parser.add_argument("--candidates", type=int, default=3, help="processes per lock (3)")
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="throwaway cluster with fsync, synchronous_commit and full_page_writes off",
    )
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    if args.candidates < 2:
        parser.error("--candidates must be >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    interrupt_on_signals()
    started = time.monotonic()
    settings = None if args.no_fsync else DURABLE
    try:
        with database(args.dsn, max_connections=100, settings=settings) as dsn:
            info = {**machine_info(), **server_info(dsn)}
            print(describe_machine(info))
            if not args.dsn:
                print(f"Cluster settings: {settings or 'fsync, synchronous_commit off'}")
            results = asyncio.run(run(dsn, args))
    except KeyboardInterrupt:
        print("\nInterrupted; every candidate process is killed.")
        return 130
    print(f"\nTotal time {time.monotonic() - started:.0f} s")
    if args.json:
        payload = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps(payload | {"results": results}, indent=2))
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
