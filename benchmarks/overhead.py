"""What a lock costs: per attempt, while idle, in memory, and at scale.

Four measurements, each printed as a Markdown table:

1. **Per attempt** (``attempt``): ``try_lock`` + ``unlock`` through the psycopg
   ``LockSession`` adapter, each call bounded the way the lifecycle task bounds it (its
   ``CallGuard``) and, for comparison, inside ``asyncio.timeout``, against raw psycopg
   ``AsyncConnection.execute`` of the same SQL on a connection of its own (plain, and
   inside ``asyncio.timeout``). The variants run interleaved in blocks, in a shuffled
   order each round; the overhead is the median over rounds of (variant / raw).
   Round-trip times of every backend are the subject of ``benchmarks/roundtrip.py``;
   this script keeps to psycopg.
2. **Idle** (``idle``): 100 leaders (distinct keys, ``health_interval_s=5``) doing
   nothing for ``--idle-seconds`` (60): CPU seconds of this process
   (``time.process_time``, ``getrusage``), voluntary context switches (wake-ups), and the
   statements issued: calls into the session (a counting wrapper), and on the server
   ``pg_stat_statements`` when it is loaded, else the ``xact_commit`` delta of
   ``pg_stat_database`` (approximate: backends flush those counters lazily).
3. **Memory** (``memory``): 200 leaders: the RSS delta per lock, then (in a second,
   separate batch) the Python allocations per lock as ``tracemalloc`` sees them.
4. **Scale** (``scale``): 1,000 ``LeaderLock``s with distinct keys in this one process
   against one server with ``max_connections=1200``: how many became leader, how long
   it took, RSS, file descriptors, idle CPU, shutdown time.

Usage::

    python benchmarks/overhead.py                       # everything (about 2 minutes)
    python benchmarks/overhead.py --only attempt --rounds 100
    python benchmarks/overhead.py --idle-seconds 10 --max-locks 300

Without ``--dsn`` a throwaway cluster is started with ``max_connections`` raised and
``pg_stat_statements`` loaded (and removed afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

# The measurements: _overhead_attempt.py (1) and _overhead_locks.py (2-4), with the
# counters and helpers of _overhead_tools.py.
from _common import database, describe_machine, interrupt_on_signals, machine_info, server_info
from _overhead_attempt import bench_attempt
from _overhead_locks import bench_idle, bench_memory, bench_scale
from _overhead_tools import LOG_COUNTER, Calls

SECTIONS = ("attempt", "memory", "idle", "scale")


async def run(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected sections in a fixed order (memory first, on a fresh heap)."""
    sections: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "memory": lambda: bench_memory(dsn, args.memory_locks),
        "attempt": lambda: bench_attempt(dsn, args.rounds, args.block),
        "idle": lambda: bench_idle(dsn, args.idle_locks, args.idle_seconds, args.health_interval),
        "scale": lambda: bench_scale(dsn, args.max_locks, args.scale_idle_seconds),
    }
    results: dict[str, Any] = {}
    for name, section in sections.items():
        if name in args.only:
            results[name] = await section()
            results[name]["library_log"] = dict(LOG_COUNTER.counts)
            LOG_COUNTER.report(name)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/overhead.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="section to run (repeatable)"
    )
    parser.add_argument("--rounds", type=int, default=40, help="attempt: rounds (40)")
    parser.add_argument("--block", type=int, default=200, help="attempt: calls per block (200)")
    parser.add_argument("--idle-locks", type=int, default=100, help="idle: leaders (100)")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="idle: seconds (60)")
    parser.add_argument(
        "--health-interval", type=float, default=5.0, help="idle: health_interval_s (5)"
    )
    parser.add_argument("--memory-locks", type=int, default=200, help="memory: leaders (200)")
    parser.add_argument("--max-locks", type=int, default=1000, help="scale: locks (1000)")
    parser.add_argument(
        "--scale-idle-seconds", type=float, default=10.0, help="scale: idle period (10 s)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark."""
    args = parse_args(argv)
    interrupt_on_signals()
    library_log = logging.getLogger("pgleaderlock")
    library_log.addHandler(LOG_COUNTER)
    library_log.propagate = False
    Calls.install()
    max_connections = max(1200, args.max_locks + 200)
    settings = {"shared_preload_libraries": "pg_stat_statements"}
    started = time.monotonic()
    with database(args.dsn, max_connections=max_connections, settings=settings) as dsn:
        info = {**machine_info(), **server_info(dsn)}
        print(describe_machine(info))
        try:
            results = asyncio.run(run(dsn, args))
        except KeyboardInterrupt:
            print("\nInterrupted.")
            return 130
    print(f"\nTotal time {time.monotonic() - started:.0f} s")
    if args.json:
        payload = {"machine": info, "results": results}
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
