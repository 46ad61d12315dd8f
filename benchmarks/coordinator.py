"""Coordinator benchmark: many named workers over several replicas, each replica its own
OS process, against the raw floor of the same run.

Sections (``--only`` picks some):

- ``shared``: ``sessions="shared"``, ``--names`` names (10,000) over ``--replicas``
  replicas (3), on a server with ``max_connections=100`` (a throwaway cluster by
  default). Per trial, fresh replicas: the server sessions each replica opens (counted in
  ``pg_stat_activity`` by the ``application_name`` prefix ``pgl:<group>:<member>:``), the
  time from start until every name is led and until the replicas are balanced, the idle
  CPU of each replica at steady state (``/proc/<pid>/stat`` utime + stime over
  ``--idle-s``), then SIGKILL of one replica: per name, the time until a survivor leads
  it again; and the floor: one raw psycopg session holding as many names as the killed
  replica led, another waiting for all of them in one ``pg_advisory_lock`` statement,
  the holder SIGKILLed.
- ``dedicated``: ``sessions="dedicated"``, ``--dedicated-names`` names (21) over the
  replicas, SIGKILL of one replica: per name, the time until a survivor leads it again;
  against one ``LeaderLock`` per name in the same number of processes (each process
  first leads its share, then follows the other names), and against the raw floor:
  one process with a psycopg session per name holding it, another with a session per
  name queued in ``pg_advisory_lock``. The three run interleaved, trial by trial.
- ``balance``: shared sessions, ``--balance-names`` names (300) over the replicas: the
  time until each leads its share; a replica joining: the time until it leads its share,
  and the names moved (the sum of ``Coordinator.moves`` over the replicas, and the
  acquisitions seen); then ``--steady-s`` seconds (60) at steady state: moves.
- ``capacity`` (throwaway cluster only): how many advisory locks the server's lock table
  holds with its settings (one session takes locks until the server says "out of shared
  memory"); it runs last.

Every replica reports, with its own ``time.monotonic()`` (one machine, one clock), the
moment each worker starts (a worker runs exactly while its replica leads the name) and
ends. Figures are medians and p99 (nearest rank) over trials, or over names and trials.

Usage::

    python benchmarks/coordinator.py                 # everything, ~10 min
    python benchmarks/coordinator.py --quick         # one short trial of each section
    python benchmarks/coordinator.py --only dedicated --trials 20
    python benchmarks/coordinator.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Without ``--dsn`` a throwaway PostgreSQL cluster is started (``max_connections=100``, or
more if ``--dedicated-names`` needs it) and removed afterwards. Every wait is bounded,
and every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import database, describe_machine, interrupt_on_signals, machine_info, server_info
from _coordinator_balance import run_balance
from _coordinator_bench import Bench, kill_all, load
from _coordinator_capacity import lock_capacity
from _coordinator_dedicated import DEDICATED_VARIANTS, run_dedicated
from _coordinator_replica import run_replica
from _coordinator_report import report
from _coordinator_shared import run_shared

SECTIONS = ("shared", "dedicated", "balance", "capacity")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/coordinator.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="repeatable")
    parser.add_argument("--quick", action="store_true", help="one short trial of each section")
    parser.add_argument(
        "--trials",
        type=int,
        help="trials of every section (default: 5 shared, 10 dedicated per variant, 3 balance)",
    )
    parser.add_argument("--replicas", type=int, default=3, help="replicas (3)")
    parser.add_argument("--names", type=int, default=10_000, help="names, shared (10,000)")
    parser.add_argument("--dedicated-names", type=int, default=21, help="names, dedicated (21)")
    parser.add_argument("--balance-names", type=int, default=300, help="names, balance (300)")
    parser.add_argument("--idle-s", type=float, help="idle CPU window per shared trial (10 s)")
    parser.add_argument("--steady-s", type=float, help="steady state window, balance (60 s)")
    parser.add_argument(
        "--max-connections", type=int, default=100, help="of the throwaway cluster (100)"
    )
    parser.add_argument("--failover-timeout", type=float, default=30.0, help="(30 s)")
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=20.0,
        help="dedicated: wait for balance and every standby queued before a kill (20 s)",
    )
    parser.add_argument(
        "--even-timeout",
        type=float,
        default=30.0,
        help="dedicated: after a kill, wait for the survivors to even out (30 s)",
    )
    parser.add_argument(
        "--variants",
        action="append",
        choices=DEDICATED_VARIANTS,
        help="dedicated: the variants to run (default: all; repeatable)",
    )
    parser.add_argument("--json", type=Path, help="also write every trial here")
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    quick = args.quick
    args.trials_shared = args.trials or (1 if quick else 5)
    args.trials_dedicated = args.trials or (3 if quick else 10)
    args.trials_balance = args.trials or (1 if quick else 3)
    args.idle_s = args.idle_s if args.idle_s is not None else 10.0  # about one idle tick
    args.steady_s = args.steady_s if args.steady_s is not None else (10.0 if quick else 60.0)
    if args.replicas < 2:
        parser.error("--replicas must be >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replica:
        return run_replica(json.loads(args.replica))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    interrupt_on_signals()
    log_path = Path(tempfile.gettempdir()) / f"pgleaderlock-coordinator-{os.getpid()}.log"
    started = time.monotonic()
    needed = args.replicas * (args.dedicated_names + 2) + 20 if "dedicated" in args.only else 0
    max_connections = max(args.max_connections, needed)
    results: dict[str, Any] = {}
    try:
        with database(args.dsn, max_connections=max_connections) as dsn, open(log_path, "w") as log:
            info = {**machine_info(), **server_info(dsn)}
            print(describe_machine(info))
            bench = Bench(dsn, log)
            try:
                if "shared" in args.only:
                    results["shared"] = run_shared(bench, args)
                if "dedicated" in args.only:
                    results["dedicated"] = run_dedicated(bench, args)
                if "balance" in args.only:
                    results["balance"] = run_balance(bench, args)
            finally:
                bench.close()
            if "capacity" in args.only and not args.dsn:
                results["capacity"] = lock_capacity(dsn)
            report(results, args)
            print(f"\nAt the end: {load()}")
            print(f"\nTotal time {time.monotonic() - started:.0f} s; replica log: {log_path}")
            if args.json:
                payload = {
                    "machine": info,
                    "args": vars(args) | {"json": str(args.json)},
                    "results": _jsonable(results),
                }
                args.json.write_text(json.dumps(payload, indent=2, default=str))
                print(f"Wrote {args.json}")
    except KeyboardInterrupt:
        print("\nInterrupted; every replica is killed.")
        return 130
    finally:
        kill_all()
    return 0


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
