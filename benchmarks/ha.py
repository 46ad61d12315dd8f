"""HA benchmark: a primary with a streaming standby fails over; how fast do locks follow?

Every trial starts its own pair of throwaway clusters (``support.replication``, a
primary and a ``pg_basebackup -R`` standby, about 1.3 s) and runs K in-process
``LeaderLock`` candidates (default 2) with a multi-host DSN that lists the primary, then
the standby. All times are this process's ``time.monotonic()``.

Scenarios:

- ``crash``: SIGKILL of the primary's postmaster; after ``--promote-delay`` plus a random
  ``0..--jitter`` s (an HA manager's detection and decision; the jitter samples every
  phase of the candidates' retry cadence) the standby is promoted. Measured: fault ->
  the old leader's ``on_lost``, and promotion -> the first ``on_acquired`` on the
  promoted primary. Run with the library's defaults (``ExponentialBackoff(error_max_s=
  2.0)``) and, for comparison, with ``FixedInterval(1)`` and with ``ExponentialBackoff()``
  (no cap for connection errors: the library's earlier default).
- ``switchover``: a clean ("fast") shutdown of the primary instead of the crash; the same
  measurements, library defaults.
- ``partition``: the switchover the client cannot see in time. The old leader reaches the
  primary through a TCP proxy that goes silent (a network partition); the primary is
  then stopped and the standby promoted at once, faster than the old leader's demotion
  bound (``health_interval_s + health_timeout_s`` = 7 s by default). Measured: when the
  old leader demoted itself (left LEADER: ``is_leader`` False) and when its ``on_lost``
  came (a late probe on a connection whose peer, here the proxy, still acknowledges TCP
  is awaited up to ``tcp_user_timeout_s``), and how long it still believed it led after
  the new leader's ``on_acquired`` (two leaders on two servers; only the HA manager's
  fencing prevents it).
- ``dead-first-host``: the first host of the DSN is a black hole (a listener that never
  answers), the second a healthy primary. Measured: ``start()`` -> LEADER, with
  ``connect_timeout_s`` 2 and the default 5.

Usage::

    python benchmarks/ha.py                          # everything, 5 trials, both drivers
    python benchmarks/ha.py --scenario crash --trials 9 --backend psycopg
    python benchmarks/ha.py --promote-delay 30 --jitter 0 --json /tmp/ha.json

Every wait is bounded, and every cluster and lock started here is stopped on every exit
path (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    describe_machine,
    fmt_ms,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    server_info,
    summarize,
)

from pgleaderlock import (
    ExponentialBackoff,
    FixedInterval,
    LeaderLock,
    LockOptions,
    LockState,
    RetryStrategy,
    Session,
    Timing,
)
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.blackhole import BlackHole
from support.proxy import TcpProxy
from support.replication import PrimaryStandby, multi_host_dsn

SCENARIOS = ("crash", "switchover", "partition", "dead-first-host")
BACKENDS = ("psycopg", "asyncpg")
STRATEGIES: dict[str, Callable[[], RetryStrategy | None]] = {
    "defaults": lambda: None,
    "FixedInterval(1)": lambda: FixedInterval(1.0),
    "ExponentialBackoff()": lambda: ExponentialBackoff(),
}
KEYS = (1, 2)
WAIT_S = 60.0
"""Bound of every wait for an event."""


@dataclass
class Sample:
    """The figures of one trial (seconds), by metric name."""

    scenario: str
    backend: str
    variant: str
    values: dict[str, float] = field(default_factory=dict)


class Candidate:
    """An in-process lock and when its events happened."""

    def __init__(
        self, name: str, dsn: str, backend: str, timing: Timing | None = None, **kwargs: Any
    ) -> None:
        options = LockOptions(timing=timing or Timing(), session=Session(backend=backend))
        self.lock = LeaderLock(dsn, *KEYS, name=name, options=options, **kwargs)
        self.acquired: list[float] = []
        self.demoted: list[float] = []  # left LEADER: is_leader turned False
        self.lost: list[float] = []
        self.lock.on_acquired(lambda: self.acquired.append(time.monotonic()))
        self.lock.on_lost(lambda: self.lost.append(time.monotonic()))
        self.lock.on_state_change(self._changed)

    def _changed(self, old: LockState, new: LockState) -> None:
        if old is LockState.LEADER:
            self.demoted.append(time.monotonic())


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    """Poll every 1 ms; the monotonic time ``condition`` was first seen true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.001)
    return time.monotonic()


@contextlib.asynccontextmanager
async def pair_of_clusters() -> AsyncIterator[PrimaryStandby]:
    pair = PrimaryStandby()
    try:
        await asyncio.to_thread(pair.start)
        yield pair
    finally:
        await asyncio.to_thread(pair.close)


@contextlib.asynccontextmanager
async def running(candidates: list[Candidate]) -> AsyncIterator[None]:
    """The first candidate leads, the others follow (started after it)."""
    try:
        first, *rest = candidates
        await first.lock.start()
        if not await first.lock.wait_for_leadership(timeout_s=WAIT_S):
            raise RuntimeError("the first candidate did not lead")
        for candidate in rest:
            await candidate.lock.start()
        await asyncio.sleep(0.5)  # the followers are queued on the primary
        yield
    finally:
        await asyncio.gather(
            *(c.lock.shutdown(timeout_s=15) for c in candidates), return_exceptions=True
        )


async def promote_after(
    pair: PrimaryStandby, fault_at: float, delay_s: float
) -> tuple[float, float]:
    """Promote ``delay_s`` after the fault: (when it was asked, when the standby was
    first seen writable)."""
    await asyncio.sleep(max(0.0, fault_at + delay_s - time.monotonic()))
    requested = time.monotonic()
    took = await asyncio.to_thread(pair.promote)
    return requested, requested + took


# ------------------------------------------------------------------ scenarios


async def trial_failover(
    backend: str, variant: str, fault: str, args: argparse.Namespace
) -> dict[str, float]:
    """``crash`` or ``switchover``, then promotion; K candidates with the multi-host DSN."""
    strategy = STRATEGIES[variant]()
    async with pair_of_clusters() as pair:
        dsn = pair.multi_host_dsn()
        candidates = [
            Candidate(f"c{i}", dsn, backend, retry_strategy=strategy)
            for i in range(args.candidates)
        ]
        old = candidates[0]
        async with running(candidates):
            fault_at = time.monotonic()
            if fault == "crash":
                await asyncio.to_thread(pair.crash_primary)
            else:
                await asyncio.to_thread(pair.stop_primary, "fast")
            await until(lambda: bool(old.lost), "the old leader's on_lost")
            lost_at = old.lost[0]
            delay = args.promote_delay + random.uniform(0, args.jitter)
            requested, promoted_at = await promote_after(pair, fault_at, delay)
            await until(lambda: any(c.lock.is_leader for c in candidates), "a new leader")
            first = min(t for c in candidates for t in c.acquired if t > requested)
            # A follower queued on the dying primary can be granted the lock there, when
            # the old leader's backend exits before its own: a leadership of a few ms,
            # lost with the server, and possibly overlapping the old leader's belief.
            dying = [t for c in candidates[1:] for t in c.acquired if fault_at < t < requested]
            values = {
                "fault -> old leader's on_lost": lost_at - fault_at,
                "promotion -> new leader": first - promoted_at,
                "leaderships granted by the dying primary": float(len(dying)),
            }
            if dying:
                values["old leader's belief overlapping them"] = max(0.0, lost_at - min(dying))
            return values


async def trial_partition(backend: str, variant: str, args: argparse.Namespace) -> dict[str, float]:
    """The old leader is cut off by a silent proxy; stop + promote at once."""
    async with pair_of_clusters() as pair, TcpProxy("127.0.0.1", pair.primary.port) as proxy:
        via_proxy = multi_host_dsn((proxy.listen_host, proxy.port), pair.standby)
        old = Candidate("old", via_proxy, backend)
        others = [
            Candidate(f"c{i}", pair.multi_host_dsn(), backend) for i in range(1, args.candidates)
        ]
        async with running([old, *others]):
            # A random phase of the old leader's probe cycle (health_interval_s = 5 s).
            await asyncio.sleep(random.uniform(0, 5.0))
            partitioned_at = time.monotonic()
            proxy.stall()
            await asyncio.to_thread(pair.stop_primary, "fast")
            _, promoted_at = await promote_after(pair, partitioned_at, 0.0)
            await until(lambda: any(c.lock.is_leader for c in others), "a new leader")
            new_at = min(t for c in others for t in c.acquired if t > partitioned_at)
            await until(lambda: bool(old.lost), "the old leader's on_lost")
            demoted_at, lost_at = old.demoted[0], old.lost[0]
            proxy.resume()
            return {
                "promotion -> new leader": new_at - promoted_at,
                "partition -> old leader demoted (is_leader False)": demoted_at - partitioned_at,
                "partition -> old leader's on_lost": lost_at - partitioned_at,
                "two leaders (old demoted - new on_acquired)": max(0.0, demoted_at - new_at),
            }


async def trial_dead_first_host(
    backend: str, variant: str, pg: ThrowawayPostgres, args: argparse.Namespace
) -> dict[str, float]:
    timeout_s = float(variant.removeprefix("connect_timeout_s="))
    with BlackHole() as hole:
        timing = Timing(connect_timeout_s=timeout_s)
        candidate = Candidate("c", multi_host_dsn(hole, pg), backend, timing)
        began = time.monotonic()
        try:
            await candidate.lock.start()
            if not await candidate.lock.wait_for_leadership(timeout_s=WAIT_S):
                raise RuntimeError("no leader behind the black hole")
            return {"start -> leader": time.monotonic() - began}
        finally:
            await candidate.lock.shutdown(timeout_s=15)


# ------------------------------------------------------------------ the run


def plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(scenario, backend, variant) of every experiment, in the order they run."""
    variants = {
        "crash": list(STRATEGIES),
        "switchover": ["defaults"],
        "partition": ["defaults"],
        "dead-first-host": ["connect_timeout_s=2", "connect_timeout_s=5"],
    }
    return [
        (scenario, backend, variant)
        for scenario in args.scenario
        for backend in args.backend
        for variant in variants[scenario]
    ]


@contextlib.contextmanager
def single_cluster(needed: bool) -> Iterator[ThrowawayPostgres | None]:
    if not needed:
        yield None
        return
    with ThrowawayPostgres() as pg:
        yield pg


async def run(args: argparse.Namespace) -> list[Sample]:
    samples: list[Sample] = []
    experiments = plan(args)
    with single_cluster("dead-first-host" in args.scenario) as pg:
        for trial in range(args.trials):
            order = experiments[:]
            random.shuffle(order)  # interleaved: a slow moment hits every experiment
            for scenario, backend, variant in order:
                if scenario == "dead-first-host":
                    assert pg is not None
                    values = await trial_dead_first_host(backend, variant, pg, args)
                elif scenario == "partition":
                    values = await trial_partition(backend, variant, args)
                else:
                    values = await trial_failover(backend, variant, scenario, args)
                samples.append(Sample(scenario, backend, variant, values))
                shown = ", ".join(f"{k} {fmt(k, v)}" for k, v in values.items())
                print(f"[{trial + 1}/{args.trials}] {scenario} {backend} {variant}: {shown}")
    return samples


def fmt(metric: str, value: float) -> str:
    """A count as a number, a time as ``fmt_ms`` has it."""
    return f"{value:g}" if metric.startswith("leaderships") else fmt_ms(value)


def report(samples: list[Sample]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str, str], list[float]] = {}
    for sample in samples:
        for metric, value in sample.values.items():
            key = (sample.scenario, sample.variant, metric, sample.backend)
            groups.setdefault(key, []).append(value)
    rows, out = [], []
    for (scenario, variant, metric, backend), values in groups.items():
        summary = summarize(values)
        shown = [fmt(metric, v) for v in (summary.median, summary.p95, summary.max)]
        if metric.startswith("leaderships"):
            shown[0] = f"{sum(values):g} in all"
        rows.append([scenario, variant, metric, backend, summary.n, *shown])
        out.append({"scenario": scenario, "variant": variant, "metric": metric,
                    "backend": backend, **summary.as_dict(), "values": values})  # fmt: skip
    rows.sort(key=lambda r: (SCENARIOS.index(str(r[0])), str(r[1]), str(r[2]), str(r[3])))
    headers = ["Scenario", "Settings", "Metric", "Driver", "n", "Median", "p95", "Max"]
    print()
    print(markdown_table(headers, rows))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="See the module docstring for what each scenario measures.",
    )
    parser.add_argument("--scenario", action="append", choices=SCENARIOS,
                        help="repeatable (default: all)")  # fmt: skip
    parser.add_argument("--backend", action="append", choices=BACKENDS,
                        help="repeatable (default: both)")  # fmt: skip
    parser.add_argument("--trials", type=int, default=5, help="per experiment (5)")
    parser.add_argument("--candidates", type=int, default=2, help="locks per trial (2)")
    parser.add_argument("--promote-delay", type=float, default=10.0,
                        help="seconds from the fault to the promotion (10)")  # fmt: skip
    parser.add_argument("--jitter", type=float, default=10.0,
                        help="plus a random 0..JITTER seconds (10)")  # fmt: skip
    parser.add_argument("--seed", type=int, help="random seed (delays, order)")
    parser.add_argument("--json", type=Path, help="also write every trial here")
    args = parser.parse_args(argv)
    args.scenario = args.scenario or list(SCENARIOS)
    args.backend = args.backend or list(BACKENDS)
    if args.candidates < 2:
        parser.error("--candidates must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    interrupt_on_signals()
    if args.seed is not None:
        random.seed(args.seed)
    logging.getLogger("pgleaderlock").addHandler(logging.NullHandler())
    logging.getLogger("pgleaderlock").propagate = False
    info = machine_info()
    with ThrowawayPostgres() as probe:
        info.update(server_info(probe.dsn))
    print(describe_machine(info))
    began = time.monotonic()
    try:
        samples = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    rows = report(samples)
    print(f"\n{len(samples)} trials in {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
