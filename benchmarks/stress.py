"""Randomized fault-injection stress run for pgleaderlock (not part of CI).

N candidate processes (``python -m pgleaderlock.testing.candidate``) compete for
one lock while this script injects random faults for ``--duration`` seconds:

- ``terminate_leader`` / ``terminate_follower``: ``pg_terminate_backend`` of the current
  holder's backend, or of a follower's;
- ``sigkill_respawn``: SIGKILL a candidate process (usually the leader), start a new one;
- ``step_down``: ask the leader to step down;
- ``proxy_stall``: every candidate talks to the server through its own TCP proxy; the
  leader's proxy stops forwarding for 1.5-3 s (a black-holed network: the leader must
  demote itself; the server keeps the old session, so nobody leads until it resumes).

Every candidate reports its events with timestamps; the belief checker of
``pgleaderlock.testing.beliefs`` then verifies that no two candidates ever believed they
led at the same time. Overlaps right after an external ``pg_terminate_backend`` of the
leader ("terminate overlaps", a few ms: the server frees the lock before the old leader
can know) are reported separately. Exit status 1 if any other overlap was seen, or a
terminate overlap reached ``--terminate-limit-ms``.

Usage::

    .venv/bin/python benchmarks/stress.py --duration 60            # throwaway cluster
    .venv/bin/python benchmarks/stress.py --dsn postgresql://...   # an existing server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import _common  # noqa: F401 - puts tests/ on sys.path, for support.*
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgleaderlock.testing.beliefs import BeliefLog, describe_overlaps
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.proxy import TcpProxy
from support.server import lock_holders

FAULTS: dict[str, int] = {  # relative weights
    "terminate_leader": 3,
    "terminate_follower": 1,
    "sigkill_respawn": 2,
    "step_down": 2,
    "proxy_stall": 1,
}


@dataclass
class Slot:
    """One candidate position: its proxy and its current process."""

    name: str
    mode: Literal["wait", "poll"]
    dsn: str
    proxy: TcpProxy | None = None
    proc: CandidateProcess | None = None
    stalled: bool = False


@dataclass
class Run:
    args: argparse.Namespace
    rng: random.Random
    beliefs: BeliefLog
    admin: psycopg.AsyncConnection[Any]
    keys: tuple[int, int]
    tag: str
    log: Any
    slots: list[Slot] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    fault_times: list[tuple[float, str, str]] = field(default_factory=list)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def options(self, slot: Slot) -> CandidateOptions:
        return CandidateOptions(
            health_interval_s=self.args.health_interval,
            health_timeout_s=self.args.health_timeout,
            connect_timeout_s=1.0,
            command_timeout_s=1.0,
            retry_s=self.args.retry,
            follower_mode=slot.mode,
            application_name=f"pgll-stress-{self.tag}-{slot.name}",
            shutdown_timeout_s=5.0,
        )

    async def spawn(self, slot: Slot) -> None:
        proc = CandidateProcess(
            slot.name,
            slot.dsn,
            *self.keys,
            options=self.options(slot),
            beliefs=self.beliefs,
            stderr=self.log,
        )
        await proc.start()
        slot.proc = proc

    def leader(self) -> Slot | None:
        leaders = self.beliefs.leaders()
        for slot in self.slots:
            if slot.name in leaders:
                return slot
        return None

    async def backends(self) -> dict[int, Slot]:
        """Server pid -> slot, from application_name."""
        prefix = f"pgll-stress-{self.tag}-"
        cur = await self.admin.execute(
            "SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE %s",
            (prefix + "%",),
        )
        by_name = {slot.name: slot for slot in self.slots}
        found: dict[int, Slot] = {}
        for pid, app in await cur.fetchall():
            slot = by_name.get(app[len(prefix) :])
            if slot is not None:
                found[pid] = slot
        return found

    def record(self, kind: str, slot: Slot) -> None:
        self.injected[kind] += 1
        self.fault_times.append((time.monotonic(), kind, slot.name))

    async def inject(self, kind: str) -> None:
        leader = self.leader()
        if kind in ("terminate_leader", "terminate_follower"):
            backends = await self.backends()
            held = await lock_holders(self.admin, *self.keys)
            if kind == "terminate_leader":
                targets = [(pid, backends[pid]) for pid in held if pid in backends]
            else:
                targets = [(pid, s) for pid, s in backends.items() if pid not in held]
            targets = [(pid, s) for pid, s in targets if not s.stalled]
            if not targets:
                self.skipped[kind] += 1
                return
            pid, slot = self.rng.choice(targets)
            self.beliefs.fault("terminate", slot.name)  # before the fact: it explains overlaps
            self.record(kind, slot)
            await self.admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        elif kind == "sigkill_respawn":
            pool = [s for s in self.slots if not s.stalled]
            if leader is not None and not leader.stalled and self.rng.random() < 0.7:
                slot = leader
            elif pool:
                slot = self.rng.choice(pool)
            else:
                self.skipped[kind] += 1
                return
            self.record("sigkill_leader" if slot is leader else "sigkill_follower", slot)
            assert slot.proc is not None
            await slot.proc.kill()
            await asyncio.sleep(self.rng.uniform(0.0, 0.3))
            await self.spawn(slot)
        elif kind == "step_down":
            if leader is None or leader.stalled or leader.proc is None:
                self.skipped[kind] += 1
                return
            self.record(kind, leader)
            await leader.proc.send("step_down")
        elif kind == "proxy_stall":
            if leader is None or leader.stalled or leader.proxy is None:
                self.skipped[kind] += 1
                return
            self.record(kind, leader)
            leader.stalled = True
            leader.proxy.stall()
            task = asyncio.get_running_loop().create_task(
                self.resume_later(leader, self.rng.uniform(1.5, 3.0))
            )
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def resume_later(self, slot: Slot, after_s: float) -> None:
        try:
            await asyncio.sleep(after_s)
        finally:
            if slot.proxy is not None:
                slot.proxy.resume()
            slot.stalled = False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of faults")
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--dsn", help="use this server instead of a throwaway cluster")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--min-gap", type=float, default=0.3, help="min seconds between faults")
    parser.add_argument("--max-gap", type=float, default=1.5, help="max seconds between faults")
    parser.add_argument("--no-proxy", action="store_true", help="no proxies, no proxy stalls")
    parser.add_argument("--follower-mode", choices=("wait", "poll", "mixed"), default="mixed")
    parser.add_argument("--health-interval", type=float, default=0.5)
    parser.add_argument("--health-timeout", type=float, default=0.5)
    parser.add_argument("--retry", type=float, default=0.3, help="FixedInterval delay")
    parser.add_argument("--terminate-limit-ms", type=float, default=50.0)
    parser.add_argument("--log", help="candidates' stderr (default: a temp file)")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    pg: ThrowawayPostgres | None = None
    if args.dsn:
        dsn, server = args.dsn, "the server at --dsn"
    else:
        pg = ThrowawayPostgres(max_connections=100)
        await asyncio.to_thread(pg.start)
        dsn, server = pg.dsn, f"throwaway cluster on port {pg.port}"
    log_path = args.log or tempfile.mkstemp(prefix="pgll-stress-", suffix=".log")[1]
    log = open(log_path, "ab")  # noqa: SIM115 - closed in finally
    admin = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    beliefs = BeliefLog()
    state = Run(
        args=args,
        rng=rng,
        beliefs=beliefs,
        admin=admin,
        keys=(rng.randint(1, 2**31 - 1), rng.randint(-(2**31), 2**31 - 1)),
        tag=f"{os.getpid()}",
        log=log,
    )
    info = conninfo_to_dict(dsn)
    host = str(info.get("host") or "127.0.0.1")
    use_proxy = not args.no_proxy and not host.startswith("/")
    weights = {k: w for k, w in FAULTS.items() if use_proxy or k != "proxy_stall"}
    ended = started = time.monotonic()
    try:
        for i in range(args.candidates):
            mode: Literal["wait", "poll"] = (
                ("wait", "poll")[i % 2] if args.follower_mode == "mixed" else args.follower_mode
            )
            slot = Slot(f"c{i}", mode, dsn)
            if use_proxy:
                slot.proxy = TcpProxy(host, int(info.get("port") or 5432))
                await slot.proxy.start()
                slot.dsn = make_conninfo(dsn, host="127.0.0.1", port=slot.proxy.port)
            state.slots.append(slot)
        await asyncio.gather(*(state.spawn(slot) for slot in state.slots))
        print(
            f"pgleaderlock stress: {args.duration:g} s, {args.candidates} candidates "
            f"({', '.join(s.mode for s in state.slots)}), seed {seed}, {server}, "
            f"proxies {'on' if use_proxy else 'off'}, candidates' log {log_path}",
            flush=True,
        )
        started = time.monotonic()
        deadline = started + args.duration
        kinds, kind_weights = list(weights), list(weights.values())
        while time.monotonic() < deadline:
            await asyncio.sleep(rng.uniform(args.min_gap, args.max_gap))
            if time.monotonic() >= deadline:
                break
            await state.inject(rng.choices(kinds, kind_weights)[0])
        # Let the last fault settle, then stop everyone in order.
        for task in list(state.background):
            task.cancel()
        await asyncio.gather(*state.background, return_exceptions=True)
        await asyncio.sleep(2.0)
        ended = time.monotonic()
    finally:
        for slot in state.slots:
            if slot.proxy is not None:
                slot.proxy.resume()
        await asyncio.gather(
            *(slot.proc.stop(timeout_s=10) for slot in state.slots if slot.proc is not None),
            return_exceptions=True,
        )
        for slot in state.slots:
            if slot.proxy is not None:
                await slot.proxy.close()
        await admin.close()
        log.close()
        if pg is not None:
            await asyncio.to_thread(pg.close)

    report = beliefs.report(until=ended)
    limit_s = args.terminate_limit_ms / 1000
    too_long = [o for o in report.terminate_overlaps if o.size_s >= limit_s]
    ok = not report.other_overlaps and not too_long
    print(summary(state, report, started, ended))
    print(f"result: {'OK' if ok else 'UNSAFE'}")
    if ok and not args.log:
        with contextlib.suppress(OSError):
            os.unlink(log_path)
    return 0 if ok else 1


KINDS = (
    "terminate_leader",
    "terminate_follower",
    "sigkill_leader",
    "sigkill_follower",
    "step_down",
    "proxy_stall",
)
ENDS_LEADERSHIP = ("terminate_leader", "sigkill_leader", "step_down", "proxy_stall")


def summary(state: Run, report: Any, started: float, ended: float) -> str:
    total = sum(state.injected.values())
    faults = ", ".join(f"{k} {state.injected[k]}" for k in KINDS if state.injected[k])
    skipped = ", ".join(f"{k} {n}" for k, n in state.skipped.items())
    lines = [
        f"faults for {state.args.duration:g} s, then 2 s to settle: {ended - started:.1f} s",
        f"faults injected: {total} ({faults})"
        + (f"; skipped, no target: {skipped}" if skipped else ""),
        f"leaderships: {len(report.intervals)}, leader changes: {report.leader_changes}",
        f"overlaps (excluding terminate overlaps): {len(report.other_overlaps)}",
        f"terminate overlaps: {describe_overlaps(report.terminate_overlaps)} "
        f"after {state.injected['terminate_leader']} leader terminations",
    ]
    for overlap in report.other_overlaps[:10]:
        lines.append("  " + overlap.describe(report.origin))
    gap = report.longest_gap
    if gap is not None:
        cause = [f for f in state.fault_times if f[0] <= gap.start]
        after = f" (last fault before it: {cause[-1][1]} of {cause[-1][2]} at " if cause else ""
        if cause:
            after += f"{cause[-1][0] - started:.1f} s)"
        lines.append(
            f"longest leaderless gap: {gap.size_s:.3f} s at {gap.start - started:.1f} s{after}"
        )
    leaderless = leaderless_time(report, started, ended)
    lines.append(f"leaderless time: {leaderless:.1f} s of {ended - started:.1f} s")
    lines.append("time from a fault on the leader to the next leadership (median / max):")
    for kind in ENDS_LEADERSHIP:
        waits = next_leader_after(report, [t for t, k, _ in state.fault_times if k == kind])
        if waits:
            lines.append(
                f"  {kind:<18} {statistics.median(waits) * 1000:8.1f} ms / "
                f"{max(waits) * 1000:8.1f} ms  (n={len(waits)})"
            )
    return "\n".join(lines)


def leaderless_time(report: Any, started: float, ended: float) -> float:
    covered = 0.0
    cursor = started
    for interval in report.intervals:
        start = max(interval.start, cursor)
        end = min(interval.end_or(ended), ended)
        if end > start:
            covered += end - start
            cursor = end
    return (ended - started) - covered


def next_leader_after(report: Any, times: list[float]) -> list[float]:
    """For each fault time: how long until a leadership began after it."""
    starts = sorted(i.start for i in report.intervals)
    waits = []
    for t in times:
        later = [s for s in starts if s > t]
        if later:
            waits.append(later[0] - t)
    return waits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.candidates < 2:
        print("--candidates must be at least 2", file=sys.stderr)
        return 2
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
