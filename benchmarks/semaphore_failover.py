"""Semaphore followers: what waiting costs, and how fast a freed slot is taken, next to a
LeaderLock's in the same run.

Cost (one process, ``--cost-seconds`` each, one after the other):

- 20 waiting followers of a ``LeaderLock`` (one holder); 20 and 100 waiting followers of
  a ``Semaphore(slots=N)`` (N holders); library defaults. Printed: the CPU of the
  followers' server backends (``/proc/<pid>/stat``: the server must run on this machine)
  and of this process, as a share of one core.

Failover (interleaved trial by trial; SIGKILL and ``pg_terminate_backend`` alternate):

- ``lock``: two candidate processes (``pgleaderlock.testing.candidate``, library
  defaults, ``follower_mode="wait"``) on one ``LeaderLock``; the leader is hit.
- ``semaphore, F waiting``: N + F candidate processes on one ``Semaphore(slots=N)``
  (N holders, F followers), for F = N + 2 down to 2; a random holder is hit. A slot gets
  a follower that waits for it on the server (its watcher) only while another follower
  stays queued behind the gate's holder, which covers the other slots by trying them
  every ``rescan_s``: with N = 2, F = 4 watches both slots, F = 3 one, F = 2 none
  (the gate's holder tries both, one follower queued behind it).
- ``semaphore, 1 waiting rescan=R``: N + 1 processes: the one follower holds the gate
  and tries every slot each ``rescan_s`` (one configuration per ``--rescan``).

The time is the hit -> the next holder's ``acquired`` event (``on_acquired`` ran), from
each process's own ``time.monotonic()`` (one machine, one clock). A SIGKILLed process is
replaced by a new one, which becomes the next trial's waiter; a terminated one
reconnects and waits. See ``docs/guides/semaphores.md``.

Usage::

    python benchmarks/semaphore_failover.py                       # 20 trials, N=2
    python benchmarks/semaphore_failover.py --trials 40 --slots 3 --rescan 0.05 --rescan 0.01
    python benchmarks/semaphore_failover.py --cost-seconds 0      # failover only
    python benchmarks/semaphore_failover.py --dsn postgresql://postgres@127.0.0.1:5432/test

Without ``--dsn`` a throwaway PostgreSQL cluster is started (and removed afterwards).
Every wait is bounded, and every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
from _common import (
    database,
    describe_machine,
    fmt_ms,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    server_info,
    summarize,
)

from pgleaderlock import LeaderLock, LockOptions, Semaphore
from pgleaderlock.core.semaphore import DEFAULT_RESCAN_S
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess, candidate_command

EVENT_TIMEOUT_S = 30.0


class Candidate(CandidateProcess):
    """A candidate process on the lock or semaphore ``lock_name``."""

    def __init__(self, name: str, dsn: str, lock_name: str, options: CandidateOptions) -> None:
        super().__init__(name, dsn, 0, 0, options=options)
        self.lock_name = lock_name

    def argv(self) -> list[str]:
        return candidate_command(lock_name=self.lock_name, name=self.name, options=self.options)

    @property
    def leads(self) -> bool:
        return self.find("acquired") is not None and self.is_leader


@dataclass
class Setup:
    """One configuration: its processes and its trials."""

    label: str
    dsn: str
    options: CandidateOptions
    size: int  # processes
    holders: int  # how many lead at once
    lock_name: str = field(default_factory=lambda: f"bench-sema-{uuid.uuid4().hex[:10]}")
    procs: list[Candidate] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    made: int = 0

    async def spawn(self) -> Candidate:
        self.made += 1
        proc = Candidate(f"{self.label}-{self.made}", self.dsn, self.lock_name, self.options)
        await proc.start()
        self.procs.append(proc)
        return proc

    async def settled(self) -> None:
        """``holders`` lead and the others have failed an attempt (they compete)."""
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while True:
            leading = [p for p in self.procs if p.is_leader]
            waiting = [p for p in self.procs if not p.is_leader and p.find("acquire_failed")]
            if len(leading) == self.holders and len(waiting) == len(self.procs) - self.holders:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label}: {len(leading)} lead, {len(waiting)} wait")
            await asyncio.sleep(0.01)

    async def trial(self, rng: random.Random, terminate: bool) -> float:
        await self.settled()
        waiters = [p for p in self.procs if not p.is_leader]
        victim = rng.choice([p for p in self.procs if p.is_leader])
        pid = victim.backend_pid
        # The time just before the hit: kill() reads the clock after it, and on a busy
        # machine the waiter may have been told it leads before this process runs again.
        killed_at = time.monotonic()
        if terminate and pid is not None:
            async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                killed_at = time.monotonic()
                await conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        else:
            await victim.kill()
            self.procs.remove(victim)
        event = await _first_acquired(self.label, waiters, killed_at)
        took = event - killed_at
        self.times.append(took)
        if not terminate:
            await self.spawn()  # the next trial's waiter
        return took

    async def close(self) -> None:
        for proc in self.procs:
            await proc.kill()


async def _first_acquired(label: str, waiters: list[Candidate], since: float) -> float:
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while time.monotonic() < deadline:
        times = [e.t for p in waiters if (e := p.find("acquired", since=since)) is not None]
        if times:
            return min(times)
        await asyncio.sleep(0.005)
    seen = {p.name: [(e.event, round(e.t - since, 3)) for e in p.events[-6:]] for p in waiters}
    raise TimeoutError(f"{label}: no waiter acquired after the kill; last events {seen}")


async def run(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    base = CandidateOptions.library_defaults(quiet=True)
    n = args.slots
    sem = CandidateOptions.library_defaults(quiet=True, slots=n)
    setups = [Setup("lock", dsn, base, size=2, holders=1)]
    for followers in range(n + 2, 1, -1):
        label = f"semaphore, {followers} waiting"
        setups.append(Setup(label, dsn, sem, size=n + followers, holders=n))
    for rescan in args.rescan:
        options = CandidateOptions.library_defaults(quiet=True, slots=n, rescan_s=rescan)
        setups.append(Setup(f"semaphore, 1 waiting rescan={rescan:g}", dsn, options, n + 1, n))
    rng = random.Random(args.seed)
    try:
        for setup in setups:
            for _ in range(setup.size):
                await setup.spawn()
        for trial in range(args.trials):
            terminate = trial % 2 == 1  # SIGKILL and terminate, interleaved
            for setup in setups:  # interleaved: the same noise for each
                took = await setup.trial(rng, terminate)
                if args.verbose:
                    hit = "terminate" if terminate else "SIGKILL"
                    print(f"trial {trial + 1:>3} {setup.label:<32} {hit:<9} {fmt_ms(took)}")
    finally:
        for setup in setups:
            await setup.close()
    return {setup.label: setup.times for setup in setups}


def _backend_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the server backends ``pids`` have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def cost(
    dsn: str, slots: int | None, followers: int, seconds: float, settle_s: float
) -> tuple[float, float]:
    """The server's and this process's CPU, as shares of a core, while ``followers``
    followers of a lock (``slots`` None) or of a semaphore wait for ``seconds``, from
    ``settle_s`` after they started."""
    name = f"bench-cost-{uuid.uuid4().hex[:10]}"
    options = LockOptions(load_plugins=False)

    def make() -> LeaderLock:
        if slots is None:
            return LeaderLock.from_name(name, dsn, options=options)
        return Semaphore(dsn, name, slots=slots, options=options)

    holders = [make() for _ in range(slots or 1)]
    waiting = [make() for _ in range(followers)]
    try:
        for lock in holders:
            await lock.start()
            if not await lock.wait_for_leadership(EVENT_TIMEOUT_S):
                raise TimeoutError(f"{name}: a holder did not lead")
        for lock in waiting:
            await lock.start()
        await asyncio.sleep(settle_s)  # every follower is past its first attempts
        if any(lock.is_leader for lock in waiting):
            raise RuntimeError(f"{name}: a follower leads")
        pids = [pid for lock in waiting if (pid := lock.backend_pid) is not None]
        server, client, started = _backend_cpu_s(pids), _own_cpu_s(), time.monotonic()
        await asyncio.sleep(seconds)
        took = time.monotonic() - started
        return (_backend_cpu_s(pids) - server) / took, (_own_cpu_s() - client) / took
    finally:
        async with asyncio.timeout(60):
            await asyncio.gather(*(lock.shutdown(10) for lock in (*waiting, *holders)))


async def costs(args: argparse.Namespace, dsn: str) -> list[list[object]]:
    rows: list[list[object]] = []
    for label, slots, followers in (
        ("LeaderLock", None, 20),
        (f"Semaphore(slots={args.slots})", args.slots, 20),
        (f"Semaphore(slots={args.slots})", args.slots, 100),
    ):
        server, client = await cost(dsn, slots, followers, args.cost_seconds, args.settle)
        rows.append([label, followers, f"{server * 100:.2f}%", f"{client * 100:.2f}%"])
        print(f"cost: {label} x {followers}: server {server:.2%}, client {client:.2%}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", help="an existing server (default: a throwaway cluster)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--slots", type=int, default=2, help="N (default 2)")
    parser.add_argument(
        "--rescan",
        type=float,
        action="append",
        help=f"a semaphore configuration's rescan_s (repeatable; default {DEFAULT_RESCAN_S})",
    )
    parser.add_argument(
        "--cost-seconds", type=float, default=15.0, help="each cost measurement (0: none)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds from the followers' start to the cost measurement",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    args = parser.parse_args()
    args.rescan = args.rescan or [DEFAULT_RESCAN_S]
    interrupt_on_signals()
    with database(args.dsn) as dsn:
        print(describe_machine({**machine_info(), **server_info(dsn)}))
        print(f"Load average (1 min) at the start: {os.getloadavg()[0]:.2f}", flush=True)
        cost_rows = asyncio.run(costs(args, dsn)) if args.cost_seconds > 0 else []
        results = asyncio.run(run(args, dsn)) if args.trials > 0 else {"lock": []}
        print(f"Load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    if cost_rows:
        print()
        print(f"Waiting followers, {args.cost_seconds:g} s each: CPU as a share of one core")
        print(markdown_table(["followers of", "followers", "server", "client"], cost_rows))
    if not results["lock"]:
        return 0
    lock = summarize(results["lock"])
    rows = []
    for label, times in results.items():
        summary = summarize(times)
        ratio = summary.median / lock.median if lock.median else float("nan")
        spread = [fmt_ms(summary.median), fmt_ms(summary.p95), fmt_ms(summary.max)]
        rows.append([label, summary.n, *spread, f"{ratio:.2f}x"])
    print()
    print(
        f"Failover after SIGKILL or terminate of a holder, interleaved (N={args.slots}): "
        "hit -> next on_acquired"
    )
    print(markdown_table(["setup", "trials", "median", "p95", "max", "median / lock"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
