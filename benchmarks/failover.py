"""Failover benchmark: pgleaderlock against the peers a user would otherwise pick.

K candidate processes (default 3) compete for one lock; the parent injects a fault on
the leader and measures, from each process's own ``time.monotonic()`` (one machine, one
clock):

- **time to new leader**: fault -> the new leader's "acquired" event (the moment user
  code is told it leads);
- **detection** (terminated backend only): fault -> the old leader's "lost" event;
- **double-leader window** (terminated backend only): how long the old leader still
  believed it led after the new one had been told it leads.

Scenarios: ``crash`` (SIGKILL of the leader process), ``graceful`` (SIGTERM: the
candidate releases the lock and exits) and ``terminate`` (``pg_terminate_backend`` of
the backend holding the lock, found in ``pg_locks``; the old leader's process lives on).

Implementations, each a separate set of K processes running the same lock name:

- ``pgleaderlock-wait``: ``LeaderLock`` defaults (``follower_mode="wait"``).
- ``pgleaderlock-poll-exp``: ``follower_mode="poll"``, ``ExponentialBackoff()`` (spec
  defaults: 1 s doubling to 30 s).
- ``pgleaderlock-poll-1s``: ``follower_mode="poll"``, ``FixedInterval(1.0)``.
- ``raw-block``: psycopg 3, ``pg_advisory_lock`` in a loop; the leader blocks in
  ``select()`` on its socket. The physical floor.
- ``raw-poll-1s``: psycopg 3, ``pg_try_advisory_lock`` every 1 s; the leader runs
  ``SELECT 1`` every 1 s.
- ``tooz``: OpenStack tooz's PostgreSQL driver, ``get_lock(name).acquire(blocking=True)``,
  ``heartbeat()`` every 1 s while leading.
- ``asyncpg-lock``: ``AdvisoryLockGuard`` with its defaults (5 s re-acquire poll, 5 s
  delay after acquiring before the leader's function runs, keep-alive every 5/3 s).

Sub-millisecond implementations (pgleaderlock-wait, raw-block, tooz) run one trial at a
time, interleaved round-robin, with nothing else of this benchmark running. The ones
that poll in seconds run afterwards, ``--jobs`` experiments at a time.

Usage::

    python benchmarks/failover.py                      # everything, 20 trials each
    python benchmarks/failover.py --impl pgleaderlock-wait --impl raw-block --trials 50
    python benchmarks/failover.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Without ``--dsn`` a throwaway PostgreSQL cluster is started (and removed afterwards).
Every wait is bounded, and every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import database, describe_machine, interrupt_on_signals, machine_info, server_info
from _failover_experiment import Experiment, kill_all, run_interleaved, say
from _failover_impls import IMPLS, SCENARIOS
from _failover_report import report
from _failover_workers import run_worker


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/failover.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument(
        "--impl",
        action="append",
        choices=list(IMPLS),
        help="implementation to run (repeatable; default: all)",
    )
    parser.add_argument(
        "--scenario", action="append", choices=SCENARIOS, help="repeatable; default: all"
    )
    parser.add_argument("--trials", type=int, default=20, help="faults per scenario (20)")
    parser.add_argument("--candidates", type=int, default=3, help="processes per lock (3)")
    parser.add_argument(
        "--jobs", type=int, default=4, help="coarse (polling) experiments run at once (4)"
    )
    parser.add_argument(
        "--settle", type=float, default=0.5, help="wait at least this before a fault (0.5 s)"
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=1.0,
        help="plus a random 0..jitter s, so faults hit every phase of a poll cycle (1 s)",
    )
    parser.add_argument(
        "--failover-timeout", type=float, default=45.0, help="wait for a new leader (45 s)"
    )
    parser.add_argument(
        "--detect-timeout",
        type=float,
        default=10.0,
        help="wait for the old leader to notice a terminated backend (10 s)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        help="wait for one leader and K-1 followers before a fault (60 s)",
    )
    parser.add_argument("--json", type=Path, help="also write all trials and figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--lock-name", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.impl = args.impl or list(IMPLS)
    args.scenario = args.scenario or list(SCENARIOS)
    if args.candidates < 2 or args.trials < 1 or args.jobs < 1:
        parser.error("--candidates must be >= 2, --trials and --jobs >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, be one candidate process)."""
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.lock_name)
    interrupt_on_signals()
    abort = threading.Event()
    log_path = Path(tempfile.gettempdir()) / f"pgleaderlock-failover-{os.getpid()}.log"
    results: dict[tuple[str, str], Experiment] = {}
    started = time.monotonic()
    try:
        with database(args.dsn, max_connections=300) as dsn, open(log_path, "w") as log:
            info = {**machine_info(), **server_info(dsn)}
            print(describe_machine(info))
            print(f"K={args.candidates} candidates, {args.trials} trials per scenario")

            def make(key: str, scenario: str) -> Experiment:
                exp = Experiment(IMPLS[key], scenario, dsn, args, log, abort)
                results[(key, scenario)] = exp
                return exp

            precise = [k for k in args.impl if not IMPLS[k].coarse]
            coarse = [k for k in args.impl if IMPLS[k].coarse]
            for scenario in args.scenario:
                if precise:
                    say(f"\n== {scenario}: {', '.join(precise)} (interleaved, one at a time)")
                    run_interleaved([make(k, scenario) for k in precise], args.trials)
            if coarse:
                say(f"\n== {', '.join(coarse)} ({args.jobs} experiments at a time)")
                exps = [make(k, s) for k in coarse for s in args.scenario]
                with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                    futures = [pool.submit(exp.run_all) for exp in exps]
                    try:
                        for future in futures:
                            future.result()
                    except BaseException:
                        abort.set()  # before the pool waits for its threads
                        raise
            figures = report(results, args)
            print(f"\nTotal time {time.monotonic() - started:.0f} s; worker log: {log_path}")
            if args.json:
                payload = {"machine": info, "args": _json_args(args), "results": figures}
                args.json.write_text(json.dumps(payload, indent=2))
                print(f"Wrote {args.json}")
    except KeyboardInterrupt:
        abort.set()
        print("\nInterrupted; every worker is killed.")
        return 130
    finally:
        abort.set()
        kill_all()
    return 0


def _json_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("worker", "lock_name", "json")}


if __name__ == "__main__":
    sys.exit(main())
