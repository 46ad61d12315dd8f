"""Semaphore failover: how fast a freed slot is taken, next to a LeaderLock's failover.

In one run, interleaved trial by trial:

- ``lock``: two candidate processes (``pgleaderlock.testing.candidate``, library
  defaults, ``follower_mode="wait"``) on one ``LeaderLock``; the leader is SIGKILLed.
- ``semaphore rescan=R``: N + 1 candidate processes on one ``Semaphore(slots=N)`` with
  ``rescan_s=R`` (one configuration per ``--rescan``); a random holder is SIGKILLed.

The time is kill -> the next holder's ``acquired`` event (``on_acquired`` ran), from each
process's own ``time.monotonic()`` (one machine, one clock). The killed process is
replaced by a new one, which becomes the next trial's waiter. A semaphore's follower
cannot wait on the server for "any of N slots"; it tries every slot each ``rescan_s``
(see ``docs/guides/semaphores.md``), so its failover is about ``rescan_s / 2`` plus a few
round trips, while a lock's follower is granted the lock by the server at once.

Usage::

    python benchmarks/semaphore_failover.py                       # 20 trials, N=2
    python benchmarks/semaphore_failover.py --trials 40 --slots 3 --rescan 0.05 --rescan 0.01
    python benchmarks/semaphore_failover.py --dsn postgresql://postgres@127.0.0.1:5432/test

Without ``--dsn`` a throwaway PostgreSQL cluster is started (and removed afterwards).
Every wait is bounded, and every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

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

    async def trial(self, rng: random.Random) -> float:
        await self.settled()
        waiters = [p for p in self.procs if not p.is_leader]
        victim = rng.choice([p for p in self.procs if p.is_leader])
        # The time just before the signal: kill() reads the clock after it, and on a busy
        # machine the waiter may have been told it leads before this process runs again.
        killed_at = time.monotonic()
        await victim.kill()
        self.procs.remove(victim)
        event = await _first_acquired(self.label, waiters, killed_at)
        took = event - killed_at
        self.times.append(took)
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
    setups = [Setup("lock", dsn, base, size=2, holders=1)]
    for rescan in args.rescan:
        options = CandidateOptions.library_defaults(quiet=True, slots=args.slots, rescan_s=rescan)
        setups.append(
            Setup(f"semaphore rescan={rescan:g}", dsn, options, args.slots + 1, args.slots)
        )
    rng = random.Random(args.seed)
    try:
        for setup in setups:
            for _ in range(setup.size):
                await setup.spawn()
        for trial in range(args.trials):
            for setup in setups:  # interleaved: the same noise for each
                took = await setup.trial(rng)
                if args.verbose:
                    print(f"trial {trial + 1:>3} {setup.label:<24} {fmt_ms(took)}", flush=True)
    finally:
        for setup in setups:
            await setup.close()
    return {setup.label: setup.times for setup in setups}


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
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    args = parser.parse_args()
    args.rescan = args.rescan or [DEFAULT_RESCAN_S]
    interrupt_on_signals()
    with database(args.dsn) as dsn:
        print(describe_machine({**machine_info(), **server_info(dsn)}))
        results = asyncio.run(run(args, dsn))
    lock = summarize(results["lock"])
    rows = []
    for label, times in results.items():
        summary = summarize(times)
        ratio = summary.median / lock.median if lock.median else float("nan")
        spread = [fmt_ms(summary.median), fmt_ms(summary.p95), fmt_ms(summary.max)]
        rows.append([label, summary.n, *spread, f"{ratio:.2f}x"])
    print()
    print(f"Failover after SIGKILL of a holder (N={args.slots}): kill -> next on_acquired")
    print(markdown_table(["setup", "trials", "median", "p95", "max", "median / lock"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
