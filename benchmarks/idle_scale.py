"""Idle at scale: N leaders in one process, N followers of the same names in another.

For each configuration (library variant x N) the script starts a *leaders* process that
holds N ``LeaderLock`` s (distinct names, default settings) and, once they all lead, a
*followers* process with N ``LeaderLock`` s of the same names (default ``follower_mode``
"wait": each follower is queued on the server). After ``--settle`` seconds it measures,
over a window of ``--minutes``:

- **leaderships lost**: ``on_lost`` calls in the leaders process, how often a leader left
  LEADER at all (a late probe demotes to RECONNECTING without ``on_lost``), how many
  followers were granted a lock (each one is a leadership that went elsewhere), and the
  library's ``probe_late`` / ``health_check_failed`` / ``leadership_recovered`` records;
- **server CPU**: utime + stime of every process of the server (the precise
  ``/proc/<pid>/schedstat`` runtime when the kernel has it), split into the leaders'
  backends, the followers' backends (pids as ``backend_pid`` reports them) and the rest
  (postmaster, background processes, this script's own session). At idle the leaders'
  backends run nothing but the health probes: their CPU *is* the probes' server cost;
- **client CPU** of the leaders process and of the followers process (``/proc/<pid>/stat``);
- **probes** the server ran, from ``pg_stat_statements`` (calls and execution time of the
  probe statements, told apart by their text), against ``N * window / health_interval_s``;
  a probe that is a bare protocol Sync runs no statement, and is counted by the client
  (``statistics().probes``);
- **the machine**: how busy both cores were (``/proc/stat``), so a noisy neighbour shows;
- **start-up**: how long the N leaders took to all lead, and the client and server CPU
  that took.

Variants: ``--variant LABEL=SRC`` runs the worker processes with ``PYTHONPATH=SRC`` (a
checkout's ``src/``: the library as it was at some commit); ``--variant raw`` runs raw
driver sessions instead (each leader ``pg_try_advisory_lock`` once, then idle; each
follower queued in ``pg_advisory_lock``, its socket watched by the event loop): the floor;
``--variant raw-probe`` is the same with each raw leader also running the library's
periodic probe statement every 5 s at a random phase (what a hand-written loop with the
same check would cost: the driver's and the kernel's share of a probe); ``--variant
raw-ping`` has each raw psycopg leader send a bare protocol Sync every 5 s instead, from a
reader that stays on the event loop and a timer (no task): the floor of the library's
psycopg probe.
Without ``--variant`` the workers inherit this process's environment (so ``PYTHONPATH=...
python benchmarks/idle_scale.py`` measures that library). Configurations run
interleaved: for each N, every variant in turn. The worker side uses only public API
that every version of the library has had (``LeaderLock.from_name``, the ``on_*``
callbacks, ``statistics()``, ``backend_pid``).

``--neighbour [K]`` runs K CPU-bound busy loops (bounded: each ends by itself after the
window) during every measurement window. ``--probe-cost`` instead measures what one probe
costs the server against ``max_connections`` and the locks held (``pg_locks`` probe,
the periodic probe, ``SELECT 1``), each on a throwaway cluster of its own.

Usage::

    python benchmarks/idle_scale.py                     # N = 100, 500, 1000; 2 min each
    python benchmarks/idle_scale.py --n 1000 --minutes 10 --neighbour
    python benchmarks/idle_scale.py --variant before=/work/before/src --variant after=src \\
        --variant raw --minutes 2
    python benchmarks/idle_scale.py --backend asyncpg --n 500
    python benchmarks/idle_scale.py --probe-cost

Without ``--dsn`` a throwaway cluster is started (``max_connections`` = 2500,
``pg_stat_statements`` loaded) and removed afterwards. Every wait is bounded, and every
process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import database, describe_machine, interrupt_on_signals, machine_info, server_info
from _idle_scale_parent import Variant, kill_all_workers
from _idle_scale_probe_cost import probe_cost
from _idle_scale_run import Config, print_startup, print_tables, run_config, run_startup
from _idle_scale_server import Server
from _idle_scale_worker import worker_main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/idle_scale.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument(
        "--n", type=int, action="append", help="leaders (repeatable; 100, 500, 1000)"
    )
    parser.add_argument("--minutes", type=float, default=2.0, help="measurement window (2)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before the window (10)")
    parser.add_argument(
        "--variant",
        type=Variant.parse,
        action="append",
        help="LABEL=SRC (the library in SRC), raw, or current (repeatable; default current)",
    )
    parser.add_argument("--backend", choices=("psycopg", "asyncpg"), default="psycopg")
    parser.add_argument(
        "--followers-connect-fn", action="store_true",
        help="library followers open their sessions through connect_fn (the driver's own "
        "connection class) instead of a DSN",
    )  # fmt: skip
    parser.add_argument(
        "--neighbour", type=int, nargs="?", const=1, default=0,
        help="CPU-bound busy loops during each window (--neighbour alone: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--max-connections", type=int, default=2500, help="throwaway cluster (2500)"
    )
    parser.add_argument(
        "--no-statements", action="store_true", help="do not load pg_stat_statements"
    )
    parser.add_argument("--log-dir", type=Path, help="worker logs (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--startup", type=int, default=0, metavar="TRIALS",
        help="measure only the start-up of N leaders, TRIALS times per variant and N",
    )  # fmt: skip
    parser.add_argument(
        "--probe-cost", action="store_true", help="measure one probe's cost instead"
    )
    parser.add_argument(
        "--probe-cost-connections", type=lambda s: [int(v) for v in s.split(",")],
        default=[100, 2500, 5000], help="probe cost: max_connections values (100,2500,5000)",
    )  # fmt: skip
    parser.add_argument(
        "--probe-cost-locks", type=lambda s: [int(v) for v in s.split(",")],
        default=[0, 1000], help="probe cost: locks held by another session (0,1000)",
    )  # fmt: skip
    parser.add_argument(
        "--probe-cost-calls", type=int, default=2000, help="probe cost: calls per block"
    )
    # worker processes
    parser.add_argument("--worker", choices=("leaders", "followers"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--impl",
        choices=("lib", "raw", "raw-probe", "raw-ping"),
        default="lib",
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--ready-timeout", type=float, default=180.0, help=argparse.SUPPRESS)
    parser.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--connect-fn", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.n = args.n[0]
    else:
        args.n = args.n or [100, 500, 1000]
        args.variant = args.variant or [Variant.parse("current")]
    return args


def run_all(dsn: str, args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    """Every configuration, interleaved: for each N, every variant in turn."""
    results: list[dict[str, Any]] = []
    server = Server(dsn)
    if not server.statements:
        print("pg_stat_statements is not loaded: probes are not counted")
    if server.postmaster is None:
        print("The server is not on this machine: no server CPU figures")
    try:
        for n in args.n:
            for number in range(args.startup):
                for variant in random.sample(args.variant, len(args.variant)):
                    r = run_startup(dsn, server, variant, n, args.backend, log_dir)
                    results.append(r)
                    print(
                        f"  start-up {number + 1} {variant.label} N={n}: {r['seconds']:.2f} s,"
                        f" client CPU {r['client_cpu_s']:.2f} s,"
                        f" server CPU {r['server_cpu_s']:.2f} s",
                        flush=True,
                    )
            if args.startup:
                continue
            for variant in args.variant:
                config = Config(variant, n, args.backend, args.minutes, args.settle, args.neighbour,
                                args.followers_connect_fn)  # fmt: skip
                results.append(run_config(dsn, server, config, log_dir))
                print_tables(results[-1:])
    finally:
        server.close()
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one worker process)."""
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    interrupt_on_signals()
    started = time.monotonic()
    if args.probe_cost:
        info = machine_info()
        print(describe_machine({**info, "server_version": "(throwaway)"}))
        results: list[dict[str, Any]] = probe_cost(args)
    else:
        settings = (
            None if args.no_statements else {"shared_preload_libraries": "pg_stat_statements"}
        )
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="idle-scale-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        max_connections = max(args.max_connections, 2 * max(args.n) + 100)
        try:
            with database(args.dsn, max_connections=max_connections, settings=settings) as dsn:
                info = {**machine_info(), **server_info(dsn)}
                print(describe_machine(info))
                print(f"Worker logs: {log_dir}")
                for v in args.variant:
                    print(f"Variant {v.label}: {v.revision} ({v.src or 'inherited'})")
                results = run_all(dsn, args, log_dir)
        except KeyboardInterrupt:
            print("\nInterrupted.")
            return 130
        finally:
            kill_all_workers()
        if args.startup:
            print_startup(results, args.variant)
        else:
            print("\n# All configurations")
            print_tables(results)
    print(f"\nTotal time {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": info, "results": results}, indent=2, default=str)
        )
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
